"""The Paddle recorders change nothing and record everything they are given (issue 40, findings 3, 4, 5, 10): real
PaddleFormers training runs (tests/support/paddle_loops.py: tiny GLM-4.5 MoE, float32, CPU, 3 AdamW steps of 2
micro-batches; most of its routed experts get no token, hence no gradient), each in its own process.

- A recorded dygraph loop and a recorded PaddleFormers ``Trainer`` end with the unrecorded run's bits: every parameter
  and optimizer accumulator, the experts without a gradient included (the recorder writes their zeros and leaves
  ``param.grad`` None; meta.json names them per step).
- ``modules_at`` (issue 42, item 2): at step 2 every module of the family's list, each micro-batch's output and
  output gradient, in canonical names through ``[paddle.modules]``; the training ends with the unrecorded bits.
- A recording that fails (its folder gone after step 1) stops with a note in meta.json and one warning; the training
  goes on to the unrecorded run's bits.
- What the recorder cannot describe is refused when it is built, naming it: optimizer settings beyond the record, a
  trained parameter no name-map rule reads, several ranks; a bfloat16 loop without masters is recorded and said.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.run.launch import free_port
from harness.run.orchestrate import REPO_ROOT, runner_env
from tests.support.installed import absent

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(absent("paddle", "paddleformers"),
                                                  reason="needs paddle and paddleformers")]
LOOPS = REPO_ROOT / "tests" / "support" / "paddle_loops.py"


def run_mode(mode: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, str(LOOPS), mode, str(out)], env=runner_env("cpu"), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def state(out: Path) -> dict[str, bytes]:
    with np.load(out / "state.npz") as arrays:
        return {name: arrays[name].tobytes() for name in arrays.files}


def meta(out: Path) -> dict:
    return json.loads((out / "run" / "meta.json").read_text())


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain-loop")
    return out, run_mode("loop", out)


def experts(names) -> set[int]:
    """The routed experts among (canonical or Paddle) parameter names."""
    return {int(name.split(".experts.")[1].split(".")[0]) for name in names if ".experts." in name}


def test_a_recorded_paddle_loop_ends_with_the_unrecorded_loops_bits(plain_loop, tmp_path):
    plain, unrecorded = plain_loop
    result = run_mode("loop-recorded", tmp_path)
    before, after = state(plain), state(tmp_path)
    assert sorted(after) == sorted(before) and any(name.startswith("moment1.") for name in after)
    assert [name for name in before if after[name] != before[name]] == []
    # the experts without a gradient: Paddle's own view (param.grad None), per step, is what meta.json names
    without = unrecorded["without_gradient"]
    assert without["1"] and result["without_gradient"] == without
    zero_grads = meta(tmp_path)["zero_grads"]
    assert {step: experts(names) for step, names in zero_grads.items()} == \
        {f"step {step}": experts(names) for step, names in without.items() if names}
    assert result["warnings"] == [] and "stopped" not in meta(tmp_path)["capture"]


def test_modules_at_writes_the_family_modules_in_canonical_names_and_changes_nothing(plain_loop, tmp_path):
    from safetensors.numpy import load_file

    plain, _ = plain_loop
    result = run_mode("loop-modules", tmp_path)
    before, after = state(plain), state(tmp_path)
    assert [name for name in before if after[name] != before[name]] == [] and result["warnings"] == []
    held = load_file(str(tmp_path / "run" / "modules" / "step00002.safetensors"))
    for mb in (0, 1):
        for name in ("module.model.embed_tokens", "module.model.layers.0.self_attn.q_proj",
                     "module.model.layers.0.mlp.gate_up_proj", "module.model.layers.1.mlp.shared_experts",
                     "module.model.norm", "refeed.grad_output.lm_head",
                     "refeed.grad_output.model.layers.0.self_attn.o_proj"):
            assert f"mb{mb}.{name}" in held, name
    assert held["mb0.module.model.layers.0.self_attn.q_proj"].shape == (8, 4 * 32)  # tokens x heads x head_dim
    assert meta(tmp_path)["capture"]["modules_at"] == [2]


def test_a_recording_that_fails_stops_with_a_note_and_the_training_goes_on(plain_loop, tmp_path):
    plain, _ = plain_loop
    result = run_mode("loop-broken", tmp_path)
    assert state(tmp_path) == state(plain)
    written = meta(tmp_path)
    stopped = written["capture"]["stopped"]
    assert stopped["step"] == 2 and "Not a directory" in stopped["error"], stopped
    assert [s["step"] for s in written["capture"]["steps"]] == [1] and list(written["zero_grads"]) == ["step 1"]
    assert len(result["warnings"]) == 1 and "recording stopped at step 2" in result["warnings"][0]


def test_a_recorded_paddleformers_trainer_ends_with_the_unrecorded_trainers_bits(plain_loop, tmp_path):
    run_mode("trainer", tmp_path / "plain")
    result = run_mode("trainer-recorded", tmp_path / "recorded")
    before, after = state(tmp_path / "plain"), state(tmp_path / "recorded")
    assert sorted(after) == sorted(before) and any(name.startswith("moment1.") for name in after)
    assert [name for name in before if after[name] != before[name]] == []
    written = meta(tmp_path / "recorded")
    assert [s["step"] for s in written["capture"]["steps"]] == [1, 2, 3] and result["warnings"] == []
    # step 1 is the loop's (same weights and micro-batches; the schedules part after it): the same experts unreached
    _, loop = plain_loop
    assert experts(written["zero_grads"]["step 1"]) == experts(loop["without_gradient"]["1"]) != set()


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    out = tmp_path_factory.mktemp("refusals")
    return run_mode("refusals", out)


@pytest.mark.parametrize("case, named", [
    ("lazy_mode", "AdamW.lazy_mode = True"),
    ("amsgrad", "AdamW.amsgrad = True"),
    ("param groups", "a param group's own weight_decay = 0.0"),
    ("a parameter's regularizer", "regularizer = L2Decay(0.01)"),
    ("ClipGradByNorm", "grad_clip = ClipGradByNorm"),
    ("auto_skip_clip", "ClipGradByGlobalNorm.auto_skip_clip = True"),
    ("clip_grad stated otherwise", "ClipGradByGlobalNorm.clip_norm = 1.0, stated clip_grad = 0.5"),
    ("use_nesterov", "Momentum.use_nesterov = True"),
    ("rescale_grad", "Momentum.rescale_grad = 0.5"),
    ("L1Decay", "Momentum weight_decay = L1Decay"),
    ("bf16 with masters", "AdamW.multi_precision = True for bfloat16 parameters"),
    ("an unmapped trained parameter", "trained parameter extra_head.weight (2 such) is read by no rule"),
    ("a wrapped model", "reads lm_head.weight, which the model has not"),
    ("a model marked is_fleet", "name map ([paddlefleet] section) reads model.embedding.embed_tokens.weight, which "
                                "the model has not (2 such)"),
])
def test_what_the_record_does_not_describe_is_refused_naming_it(refusals, case, named):
    assert refusals[case] is not None and refusals[case].startswith("AttachError: "), refusals[case]
    assert named in refusals[case]


def test_what_the_record_describes_is_recorded(refusals):
    assert refusals["plain AdamW"] is None and refusals["plain Momentum"] is None
    assert refusals["an unmapped frozen parameter"] is None  # not trained: nothing to record
    bf16 = refusals["bf16 without masters: meta.json"]
    assert bf16["no_masters"] == "50 bfloat16 parameters updated in place, without fp32 masters (multi_precision off)"
    assert bf16["capture"]["dtype"] == "bfloat16" and bf16["capture"]["config"]["train"]["master_weights"] is False
    described = refusals["Momentum, 1-D undecayed: meta.json"]["capture"]["config"]["train"]
    assert (described["optimizer"], described["momentum"], described["weight_decay"],
            described["weight_decay_params"]) == ("sgd", 0.9, 0.01, "not_1d")


@pytest.mark.ranks
def test_on_two_ranks_the_recorder_is_refused_saying_so(tmp_path):
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--nnodes", "1",
              "--master", f"127.0.0.1:{free_port()}", "--max_restart", "0", "--log_dir", str(tmp_path / "logs"),
              sys.executable, str(LOOPS), "ranks", str(tmp_path)]
    done = subprocess.run(launch, env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        error = json.loads((tmp_path / f"rank{rank}.json").read_text())["error"]
        assert error == (f"AttachError: PaddleStepRecorder on 2 ranks (this is rank {rank}): it records a one-rank "
                         "loop only (several ranks are not built: docs/attach.md)")
