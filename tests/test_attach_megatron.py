"""The recorder in a user's Megatron-Core loop (harness/attach/megatron.py): docs/examples/attach/megatron_loop.py, a
loop written as Megatron-LM's train_step drives one (DDP, get_megatron_optimizer, OptimizerParamScheduler,
forward_backward_func with pretrain_gpt's loss function), with the one call after ``optimizer.step()``, on a registry
training case's checkpoint and data (tests/support/train.py's tiny DeepSeek-V3: 2 AdamW steps of 2 micro-batches,
1-D parameters undecayed, no clipping), against the built-in runners of a real ``compare`` of that case.

- The loop's captured run is megatron_model's step files bit for bit (every tensor of every step, the routing bias
  Megatron moves included).
- With ``--device-digests`` (no step kept, every tensor digested where it is: a GPU run's path on the CPU, the
  gradients digested before the step clips them) the capture still equals megatron_model's step files bit for bit,
  each digest checked against the kept tensor's host reference (issue 43).
- A loop that leaves out Megatron-LM's ``finalize_model_grads_func`` is found at step 1's routing bias, nothing before.
- The loop with the recorder ends with the loop's bits without it (every parameter, every optimizer state tensor).
- Two captures, the Megatron loop's and the HF Trainer's (docs/examples/attach/hf_trainer.py), compared with
  compare-runs give the compare's own per-step table (Megatron-Core against HF), but for the one cell the stacks
  differ in what they compute: the Trainer computes a grad norm without clipping, hf_model's runner none.
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
CASE = {**TINY_TRAIN, "weight_decay_params": "not_1d", "clip_grad": 0.0}


@pytest.fixture(scope="module")
def compared(tmp_path_factory, checkpoints_dir):
    """A real compare of the case, Megatron-Core (side a) against HF (side b): its report and side folders."""
    if absent("megatron.core", "transformers", "accelerate"):
        pytest.skip("needs megatron-core, transformers and accelerate")
    root = tmp_path_factory.mktemp("attach-megatron")
    cases = write_cases(root, tiny_train_case("t_attach_meg", train=CASE))
    result, _, report, tails = run_train_case("t_attach_meg", cases, root, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    return report, {side["label"]: Path(side["folder"]) for side in report["sides"]}


def run_example(script: str, folder: Path, out: Path, *options) -> Path:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), str(folder / "request.json"), str(out), *options],
                          env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_megatron_loop_with_the_hook_gives_megatron_models_bits(compared, tmp_path):
    _, folders = compared
    captured = run_example("megatron_loop.py", folders["a"], tmp_path / "loop")
    result, run_dir = compare_runs(folders["a"], captured, reports_dir=tmp_path)
    train = json.loads((run_dir / "report.json").read_text())["train"]
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert len(result.tensors) == 344 and [s["verdict"] for s in train["steps"]] == ["BITWISE_PASS"] * 2
    assert all(s["scalars"]["grad_norm"]["equal"] for s in train["steps"])
    meta = json.loads((captured / "meta.json").read_text())
    builtin = json.loads((folders["a"] / "meta.json").read_text())
    assert meta["runner"] == "megatron_loop" and set(meta["versions"]) == {"torch", "megatron-core"}
    assert meta["state_locations"] == builtin["state_locations"]
    assert meta["capture"]["config"]["train"]["weight_decay_params"] == "not_1d"


def test_a_capture_digested_where_the_tensors_are_gives_megatron_models_bits(compared, tmp_path):
    _, folders = compared
    captured = run_example("megatron_loop.py", folders["a"], tmp_path / "loop", "--device-digests")
    result, run_dir = compare_runs(folders["a"], captured, reports_dir=tmp_path)
    tensors = json.loads((run_dir / "report.json").read_text())["tensors"]
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert len(result.tensors) == 344
    assert sum(t["note"] == "compared by digest (step not kept)" for t in tensors) == 344 - 2 * 3  # lr, loss, norm
    meta = json.loads((captured / "meta.json").read_text())
    assert meta["steps_kept"] == "none" and meta["step_digests"] == "bits128v1 in torch elementwise ops"


def test_the_recorded_loop_ends_with_the_unrecorded_loops_bits(compared, tmp_path):
    from safetensors.numpy import load_file

    _, folders = compared
    finals = {name: tmp_path / f"{name}.safetensors" for name in ("recorded", "unrecorded")}
    run_example("megatron_loop.py", folders["a"], tmp_path / "recorded", "--final-state", str(finals["recorded"]))
    run_example("megatron_loop.py", folders["a"], tmp_path / "unrecorded", "--final-state", str(finals["unrecorded"]),
                "--unrecorded")
    mine, theirs = (load_file(finals[name]) for name in ("recorded", "unrecorded"))
    assert mine.keys() == theirs.keys() and any(n.startswith("state0.") for n in mine)
    differing = [n for n in mine if mine[n].tobytes() != theirs[n].tobytes()]
    assert not differing, differing


def test_a_loop_without_finalize_model_grads_parts_at_the_routing_bias(compared, tmp_path):
    _, folders = compared
    captured = run_example("megatron_loop.py", folders["a"], tmp_path / "bare", "--without-finalize")
    result, run_dir = compare_runs(folders["a"], captured, reports_dir=tmp_path)
    train = json.loads((run_dir / "report.json").read_text())["train"]
    assert result.verdict == "DIFF"
    assert train["first_divergence"] == {"step": 1, "quantity": "expert_bias", "tensor":
                                         "step1.expert_bias.model.layers.1.mlp.gate.e_score_correction_bias"}
    step1 = train["steps"][0]
    assert all(q["equal"] == q["total"] for name, q in step1["quantities"].items() if name != "expert_bias")


def test_two_captures_give_the_compares_per_step_table(compared, tmp_path):
    report, folders = compared
    megatron = run_example("megatron_loop.py", folders["a"], tmp_path / "megatron")
    trainer = run_example("hf_trainer.py", folders["b"], tmp_path / "trainer")
    result, run_dir = compare_runs(megatron, trainer, reports_dir=tmp_path)
    again = json.loads((run_dir / "report.json").read_text())
    assert again["verdict"] == report["verdict"] == "DIFF" and result.exit_code == 1
    assert again["train"]["first_divergence"] == report["train"]["first_divergence"]
    ours, theirs = step_rows(again["train"]), step_rows(report["train"])
    grad_norm = 4  # step, verdict, lr, loss, grad norm, ...
    assert [row[:grad_norm] + row[grad_norm + 1:] for row in ours] == \
        [row[:grad_norm] + row[grad_norm + 1:] for row in theirs]
    assert [row[grad_norm] for row in theirs] == ["not computed by side b (hf_model)"] * 2
    assert [t["name"] for t in again["tensors"] if t["name"] != "step1.grad_norm" and t["name"] != "step2.grad_norm"] \
        == [t["name"] for t in report["tensors"]]
    assert [t["mismatches"] for t in again["tensors"] if not t["name"].endswith(".grad_norm")] == \
        [t["mismatches"] for t in report["tensors"]]
