"""The recorder in PaddleFormers' ``Trainer`` (harness/attach/paddleformers.py, paddle.py): the real
``paddleformers.trainer.Trainer`` (CPU, float32, the paddlefleet_ops stand-in) with the harness's callback, via
docs/examples/attach/paddleformers_trainer.py, on a registry training case's checkpoint and data
(tests/support/train.py's tiny DeepSeek-V3: 2 AdamW steps of 2 micro-batches, cosine schedule, clipping at 1.0, norms
and biases undecayed as the Trainer does), against a real ``compare`` of that case, Megatron-Core (side a) against
PaddleFormers (side b).

- The Trainer's captured run is paddle_model's step files bit for bit: its optimizer, schedule, clipping and
  accumulation (the loss backpropagated unscaled, the summed gradients scaled by 1/2: exact for 2 micro-batches) give
  the runner's bits here.
- compare-runs of a Megatron-Core capture (docs/examples/attach/megatron_loop.py with its one-call hook) against the
  PaddleFormers capture gives the same per-step table as ``compare --runners megatron_model,paddle_model``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.commands.compare_runs import compare_runs
from harness.report.train_section import step_rows
from harness.run.orchestrate import REPO_ROOT, runner_env
from tests.support.cases import write_cases
from tests.support.installed import absent
from tests.support.train import TINY_TRAIN, run_train_case, tiny_train_case

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("runner_workers")]
EXAMPLES = REPO_ROOT / "docs" / "examples" / "attach"


@pytest.fixture(scope="module")
def compared(tmp_path_factory, checkpoints_dir):
    if absent("megatron.core", "paddle", "paddleformers"):
        pytest.skip("needs megatron-core, paddle and paddleformers")
    root = tmp_path_factory.mktemp("attach-paddleformers")
    cases = write_cases(root, tiny_train_case("t_attach_pf", runners=["megatron_model", "paddle_model"],
                                              train={**TINY_TRAIN, "weight_decay_params": "not_1d"}))
    result, _, report, tails = run_train_case("t_attach_pf", cases, root, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    return report, {side["label"]: Path(side["folder"]) for side in report["sides"]}


def run_example(script: str, folder: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), str(folder / "request.json"), str(out)],
                          env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_paddleformers_trainer_gives_paddle_models_bits(compared, tmp_path):
    _, folders = compared
    captured = run_example("paddleformers_trainer.py", folders["b"], tmp_path / "trainer")
    result, run_dir = compare_runs(folders["b"], captured, reports_dir=tmp_path)
    train = json.loads((run_dir / "report.json").read_text())["train"]
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert len(result.tensors) == 346 and [s["verdict"] for s in train["steps"]] == ["BITWISE_PASS"] * 2
    assert all(s["scalars"][k]["equal"] for s in train["steps"] for k in ("lr", "loss", "grad_norm", "clip_coeff"))
    meta = json.loads((captured / "meta.json").read_text())
    builtin = json.loads((folders["b"] / "meta.json").read_text())
    assert meta["runner"] == "paddleformers_trainer" and meta["framework"] == "paddle"
    assert set(meta["versions"]) >= {"paddlepaddle", "paddleformers"}
    assert meta["state_locations"] == builtin["state_locations"]
    described = meta["capture"]["config"]["train"]
    assert (described["weight_decay_params"], described["clip_grad"], described["micro_batches"]) == \
        ("not_1d", 1.0, 2)


def test_a_megatron_capture_against_a_paddleformers_capture_gives_the_compares_table(compared, tmp_path):
    report, folders = compared
    megatron = run_example("megatron_loop.py", folders["a"], tmp_path / "megatron")
    paddleformers = run_example("paddleformers_trainer.py", folders["b"], tmp_path / "paddleformers")
    result, run_dir = compare_runs(megatron, paddleformers, reports_dir=tmp_path)
    again = json.loads((run_dir / "report.json").read_text())
    assert again["verdict"] == report["verdict"] == "DIFF" and result.exit_code == 1
    assert step_rows(again["train"]) == step_rows(report["train"])
    assert again["train"]["first_divergence"] == report["train"]["first_divergence"]
    assert [(t["name"], t["mismatches"]) for t in again["tensors"]] == \
        [(t["name"], t["mismatches"]) for t in report["tensors"]]
