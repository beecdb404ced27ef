"""``python -m harness compare-runs RUN_A RUN_B`` on step folders (harness/commands/compare_runs.py,
harness/compare/captured_runs.py): two runs captured before, compared as the training level compares its sides.

- The two sides' folders of a real ``compare`` of a tiny training case (Megatron-Core against HF, the float64 truth
  on) give, through compare-runs, the same per-step table, first divergence, truth tallies, verdict and exit code as
  the compare's own report.
- A run against itself is BITWISE_PASS (exit 0); a folder whose step files are not what its description says, and
  two runs of different families, are ERROR naming the tensor (exit 2).
"""

import json
import shutil

import pytest

from harness.case.train_settings import TrainSettings
from harness.cli import main
from harness.commands.compare_runs import compare_runs
from harness.compare import captured_runs
from harness.report.train_section import step_rows
from tests.support.cases import write_cases
from tests.support.train import run_train_case, tiny_train_case

pytestmark = [pytest.mark.e2e]

GLM = {"family": "glm4_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
       "n_routed_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128}


@pytest.fixture(scope="module")
def compared(tmp_path_factory, checkpoints_dir):
    """A real comparison (side a Megatron-Core, side b HF + torch, the float64 truth): its report and folders."""
    root = tmp_path_factory.mktemp("compare-runs")
    cases = write_cases(root, tiny_train_case("t_runs"))
    result, run_dir, report, tails = run_train_case("t_runs", cases, root, checkpoints_dir)
    assert result.verdict == "DIFF", (result.message, tails)
    folders = {side["label"]: side["folder"] for side in report["sides"]}
    return report, folders, root


def test_compare_runs_of_a_compares_sides_gives_its_per_step_table(compared, tmp_path):
    report, folders, _ = compared
    result, run_dir = compare_runs(folders["a"], folders["b"], truth=folders["oracle"], reports_dir=tmp_path)
    again = json.loads((run_dir / "report.json").read_text())
    assert again["verdict"] == report["verdict"] == "DIFF" and result.exit_code == 1, again["message"]
    assert again["train"]["steps"] == report["train"]["steps"]  # verdicts, scalars, counts, first output, truth
    assert step_rows(again["train"]) == step_rows(report["train"])
    assert again["train"]["first_divergence"] == report["train"]["first_divergence"] == {
        "step": 1, "quantity": "loss", "tensor": "step1.loss"}
    assert again["first_divergence"] == report["first_divergence"]
    assert [t["name"] for t in again["tensors"]] == [t["name"] for t in report["tensors"]]
    assert [t["mismatches"] for t in again["tensors"]] == [t["mismatches"] for t in report["tensors"]]
    assert (run_dir / "pictures" / "train_steps.png").exists()
    markdown = (run_dir / "report.md").read_text()
    assert "## Training steps" in markdown and "Closer to the float64 truth" in markdown


def test_the_command_line_exits_with_the_verdicts_code(compared, tmp_path):
    _, folders, _ = compared
    assert main(["compare-runs", folders["a"], folders["b"], "--reports", str(tmp_path)]) == 1
    assert main(["compare-runs", folders["b"], folders["b"], "--reports", str(tmp_path)]) == 0


def test_a_run_against_itself_is_bitwise_equal(compared, tmp_path):
    _, folders, _ = compared
    result, run_dir = compare_runs(folders["b"], folders["b"], reports_dir=tmp_path)
    train = json.loads((run_dir / "report.json").read_text())["train"]
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert [s["verdict"] for s in train["steps"]] == ["BITWISE_PASS"] * 2 and train["first_divergence"] is None


def test_step_files_that_are_not_what_the_run_says_are_an_error_naming_the_tensor(compared, tmp_path):
    _, folders, _ = compared
    copy = tmp_path / "b-copy"
    shutil.copytree(folders["b"], copy)
    request = json.loads((copy / "request.json").read_text())
    request["config"]["model"]["moe_intermediate_size"] = 24  # the description says 24, the files hold 16
    (copy / "request.json").write_text(json.dumps(request))
    result, _ = compare_runs(folders["a"], copy, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert "b-copy/steps/step00001.safetensors: tensor 'step1.grad.model.layers.1.mlp.shared_experts.down_proj" \
        in result.message, result.message
    assert "is float32[64, 16], expected float32[64, 24]" in result.message, result.message


def test_runs_of_two_families_are_an_error_naming_the_family_and_a_tensor(compared):
    """Harness logic: run B's description replaced by a GLM-4.5 one (a description double; no GLM run needed to
    see that the names differ before any file is read)."""
    _, folders, _ = compared
    a = captured_runs.read(folders["a"])
    glm = a._replace(model=GLM, source=a.source.with_name("glm-request.json"))
    with pytest.raises(captured_runs.RunError) as error:
        captured_runs.comparison_case(a, glm)
    text = str(error.value)
    assert "run A trains deepseek_v3, run B glm4_moe" in text and "tensor 'step1.grad." in text, text
    assert "absent" in text or "float32[" in text, text


def test_runs_that_differ_in_micro_batches_are_an_error_naming_the_loss(compared):
    _, folders, _ = compared
    a = captured_runs.read(folders["a"])
    more = a._replace(train=TrainSettings.from_dict({**a.train.to_dict(), "micro_batches": 4}))
    with pytest.raises(captured_runs.RunError, match=r"tensor 'step1.loss' is float32\[2\] in run A .* "
                                                     r"float32\[4\] in run B"):
        captured_runs.comparison_case(a, more)


def test_a_folder_without_a_description_is_an_error_naming_it(compared, tmp_path):
    _, folders, _ = compared
    bare = tmp_path / "bare"
    shutil.copytree(folders["b"], bare)
    (bare / "request.json").unlink()
    result, _ = compare_runs(folders["a"], bare, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and "request.json" in result.message and "capture" in result.message
