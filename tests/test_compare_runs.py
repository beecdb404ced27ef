"""``python -m harness compare-runs RUN_A RUN_B`` on step folders (harness/commands/compare_runs.py,
harness/compare/captured_runs.py): two runs captured before, compared as the training level compares its sides.

- The two sides' folders of a real ``compare`` of a tiny training case (Megatron-Core against HF, the float64 truth
  on) give, through compare-runs, the same per-step table, first divergence, truth tallies, verdict and exit code as
  the compare's own report.
- A run against itself is BITWISE_PASS (exit 0); a folder whose step files are not what its description says, and
  two runs of different families, are ERROR naming the tensor (exit 2).
- compare-runs fails closed (issue 40): runs of different lengths, a description that disagrees with its step files,
  two runs (or a truth) of other training settings or another model, and a path that does not exist are ERROR naming
  them; ``--steps N`` compares a prefix only when asked; a difference that does not change the update (the steps
  kept) is a note. These runs are the real side folders, copied and described as a recorder describes its run
  (meta.json's capture entry), the description edited: harness logic over real step files.
"""

import json
import shutil

import numpy as np
import pytest

from harness.case.train_settings import TrainSettings
from harness.cli import main
from harness.commands.compare_runs import compare_runs
from harness.compare import captured_runs
from harness.report.train_section import step_rows
from harness.run.steps import StepWriter, step_file
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


def recorded(source, folder, *, step_files=None, model=None, **train):
    """A copy of a real run described as a recorder describes its own (meta.json's capture entry, no request.json;
    the parameters weight decay applies to as a recorder reads them), with `train` fields and `model` keys changed
    and only the first `step_files` step files left."""
    train = {"weight_decay_params": captured_runs.decayed_params(captured_runs.read(source)), **train}
    shutil.copytree(source, folder)
    request = json.loads((folder / "request.json").read_text())
    (folder / "request.json").unlink()
    config = {"model": {**request["config"]["model"], **(model or {})},
              "train": {**request["config"]["train"], **train}}
    meta = json.loads((folder / "meta.json").read_text())
    meta["capture"] = {"dtype": request["dtype"], "device": "cpu", "tokens": request["tokens"], "config": config}
    (folder / "meta.json").write_text(json.dumps(meta))
    for path in (folder / "steps").iterdir():
        if step_files is not None and int(path.name[4:9]) > step_files:
            path.unlink()
    return folder


def digests_only(folder, kept):
    """Rewrites the steps not in `kept` as a run keeping only `kept` writes them: the runners' StepWriter (scalars,
    one digest per state tensor), from the step's real tensors."""
    from safetensors.numpy import load_file, save_file

    writer = StepWriter(folder, kept, lambda tensors, path, metadata: save_file(tensors, path, metadata),
                        lambda array: np.ascontiguousarray(array).view(np.uint8))
    for step in range(1, 3):
        if step not in kept:
            tensors = {name.split(".", 1)[1]: t for name, t in load_file(step_file(folder, step)).items()}
            writer.write(step, {n: t for n, t in tensors.items() if "." not in n},
                         {n: t for n, t in tensors.items() if "." in n})


@pytest.mark.parametrize("short_first", [False, True], ids=["2-vs-1", "1-vs-2"])
def test_a_run_that_stopped_early_is_an_error_naming_both_runs(compared, tmp_path, short_first):
    _, folders, _ = compared
    short = recorded(folders["b"], tmp_path / "short", step_files=1, steps=1, steps_kept=[1])
    pair = (short, folders["b"]) if short_first else (folders["b"], short)
    result, run_dir = compare_runs(*pair, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert f"({short}) ends at step 1" in result.message and f"({folders['b']}) ends at step 2" in result.message
    assert json.loads((run_dir / "report.json").read_text())["exit_code"] == 2


def test_steps_n_compares_the_first_n_steps_of_both(compared, tmp_path):
    _, folders, _ = compared
    short = recorded(folders["b"], tmp_path / "short", step_files=1, steps=1, steps_kept=[1])
    assert main(["compare-runs", str(folders["b"]), str(short), "--steps", "1", "--reports", str(tmp_path)]) == 0
    result, run_dir = compare_runs(folders["b"], short, steps=1, reports_dir=tmp_path)
    train = json.loads((run_dir / "report.json").read_text())["train"]
    assert result.verdict == "BITWISE_PASS" and [s["step"] for s in train["steps"]] == [1], result.message
    assert "run A has 2 steps: steps 1 to 1 compared (--steps 1), 2 to 2 not" in train["notes"]
    result, _ = compare_runs(folders["b"], short, steps=2, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and f"--steps 2: run B ({short}) ends at step 1" in result.message


def test_a_description_behind_or_ahead_of_its_step_files_is_an_error_naming_the_file(compared, tmp_path):
    _, folders, _ = compared
    short = recorded(folders["b"], tmp_path / "short", step_files=1, steps=1, steps_kept=[1])
    behind = recorded(folders["b"], tmp_path / "behind", steps=1, steps_kept=[1])  # steps/ still holds step 2
    result, _ = compare_runs(short, behind, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert f"{behind}/steps/step00002.safetensors holds step 2, but {behind}/meta.json field capture describes 1 " \
           "steps" in result.message, result.message
    ahead = recorded(folders["b"], tmp_path / "ahead", step_files=1)  # describes 2 steps, holds 1
    result, _ = compare_runs(folders["b"], ahead, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and f"{ahead}/steps/step00002.safetensors is missing" in result.message


def test_runs_of_other_training_settings_are_an_error_listing_each_field(compared, tmp_path):
    """The lr a recorder reports is its largest group's: an extra group at 100x the lr reads as lr 0.1."""
    _, folders, _ = compared
    other = recorded(folders["b"], tmp_path / "other", lr=0.1, betas=[0.9, 0.999])
    result, _ = compare_runs(folders["b"], other, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert "lr: 0.001 in run A, 0.1 in run B" in result.message, result.message
    assert "betas: [0.9, 0.95] in run A, [0.9, 0.999] in run B" in result.message, result.message
    model = recorded(folders["b"], tmp_path / "model", model={"rms_norm_eps": 1e-5})
    result, _ = compare_runs(folders["b"], model, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and "config.model.rms_norm_eps: 1e-06 in run A, 1e-05 in run B" \
        in result.message, result.message


def test_a_steps_kept_difference_is_a_note_and_the_verdict_stays(compared, tmp_path):
    _, folders, _ = compared
    digests = recorded(folders["b"], tmp_path / "digests", steps_kept=[1])
    digests_only(digests, kept=[1])
    result, run_dir = compare_runs(folders["b"], digests, reports_dir=tmp_path)
    notes = json.loads((run_dir / "report.json").read_text())["train"]["notes"]
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert any(n.startswith("steps_kept: [1, 2] in run A, [1] in run B") for n in notes), notes
    assert any(n.startswith("steps 2: state tensors compared by digest") for n in notes), notes
    assert "steps_kept: [1, 2] in run A" in (run_dir / "report.md").read_text()


def test_a_truth_of_other_training_settings_is_an_error_naming_the_field(compared, tmp_path):
    _, folders, _ = compared
    truth = recorded(folders["oracle"], tmp_path / "truth", lr=0.1)
    result, _ = compare_runs(folders["b"], folders["b"], truth=truth, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert f"truth run {truth} was not trained as the runs were: lr: 0.001 in run A, 0.1 in the truth" \
        in result.message, result.message


def test_a_run_path_that_does_not_exist_is_an_error_naming_it(compared, tmp_path):
    _, folders, _ = compared
    missing = tmp_path / "no-such-run"
    result, _ = compare_runs(folders["a"], missing, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.message.startswith(f"run B: {missing} does not exist"), result.message
    assert main(["compare-runs", str(missing), str(tmp_path / "no-such-log"), "--reports", str(tmp_path)]) == 2
    result, _ = compare_runs(missing, tmp_path / "no-such-log", reports_dir=tmp_path)
    assert result.message.startswith(f"run A: {missing} does not exist"), result.message


def test_a_builtin_runs_default_weight_decay_reads_as_its_stacks_own_choice(compared, tmp_path):
    """Megatron-Core's "default" leaves the 1-D parameters undecayed: a capture saying "not_1d" was trained alike, one
    saying "all" was not."""
    _, folders, _ = compared
    alike = recorded(folders["a"], tmp_path / "not_1d", weight_decay_params="not_1d")
    result, _ = compare_runs(folders["a"], alike, reports_dir=tmp_path)
    assert result.verdict == "BITWISE_PASS", result.message
    assert "weight_decay_params: 'default' (megatron-core's own: 'not_1d') in run A, 'not_1d' in run B: the same " \
        "parameters decay" in result.message, result.message
    other = recorded(folders["a"], tmp_path / "all", weight_decay_params="all")
    result, _ = compare_runs(folders["a"], other, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and "weight_decay_params: 'default' (megatron-core's own: 'not_1d') in run A, " \
        "'all' in run B" in result.message, result.message
