"""The re-feed into the users' own loops with the real stacks, against the built-in re-feed in time (docs/attach.md,
"Re-feed into your loop"; tests/test_attach_refeed.py has the torch loop and the refusals).

On a registry training case (tests/support/train.py's tiny DeepSeek-V3: 2 AdamW steps of 2 micro-batches, 1-D
parameters undecayed, no clipping, as tests/test_attach_megatron.py) the built-in ``compare --refeed`` says, per
quantity of step 2, which differences between megatron_model and hf_model step 2 made and which it carried in. The
users' loops give the same answer: the Megatron-Core loop (docs/examples/attach/megatron_loop.py) and the HF Trainer
(docs/examples/attach/hf_trainer.py) each capture a run (they are the built-in runs bit for bit,
tests/test_attach_megatron.py), ``state-for`` writes the Megatron loop's state after step 1 for the Trainer, the
Trainer re-fed from it (``state_from``) runs step 2, and ``compare-runs --refed`` attributes step 2's differences.
The other way round the Megatron-Core loop with the distributed optimizer loads the Trainer's state
(``load_state``): re-fed from its own state it gives its own bits.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.case import tensorfile
from harness.commands import state_for
from harness.commands.compare_runs import compare_runs
from harness.run.orchestrate import REPO_ROOT, runner_env
from tests.support.cases import write_cases
from tests.support.installed import absent
from tests.support.train import TINY_TRAIN, run_train_case, tiny_train_case

# Four real-stack runs of minutes each (505 s together on a shared CPU): the second tier (docs/contributing.md).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("runner_workers")]
EXAMPLES = REPO_ROOT / "docs" / "examples" / "attach"
CASE = {**TINY_TRAIN, "weight_decay_params": "not_1d", "clip_grad": 0.0}


def builtin(root: Path, checkpoints_dir: Path, name: str, runners: list[str], train: dict) -> tuple[dict, dict]:
    """The built-in re-feed in time of the case (side b re-fed from side a): its report and side folders."""
    cases = write_cases(root / name, tiny_train_case(name, runners=runners, train=train))
    result, _, report, tails = run_train_case(name, cases, root / name, checkpoints_dir, oracle=False,
                                              refeed_ops=True)
    assert result.verdict == "DIFF" and report["train"]["refeed"]["status"] == "ok", (result.message, tails)
    return report, {side["label"]: Path(side["folder"]) for side in report["sides"]}


@pytest.fixture(scope="module")
def compared(tmp_path_factory, checkpoints_dir):
    """The built-in re-feed in time both ways: megatron_model (a) against hf_model (b), and hf_model (a) against
    megatron_model with the distributed optimizer (b)."""
    if absent("megatron.core", "transformers", "accelerate"):
        pytest.skip("needs megatron-core, transformers and accelerate")
    root = tmp_path_factory.mktemp("attach-refeed")
    return {"forward": builtin(root, checkpoints_dir, "t_refeed_megatron_hf", ["megatron_model", "hf_model"], CASE),
            "backward": builtin(root, checkpoints_dir, "t_refeed_hf_megatron_do", ["hf_model", "megatron_model"],
                                {**CASE, "distributed_optimizer": True})}


def run_example(script: str, folder: Path, out: Path, *options) -> Path:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), str(folder / "request.json"), str(out), *options],
                          env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def made_and_carried(entry: dict) -> dict:
    """{quantity: {"made": n, "carried in": n}} of one step's attribution, whatever made it (the built-in re-feed
    says which part of the step made it; a state re-fed alone says made by the step)."""
    return {quantity: {how: sum(n for h, n in counts.items() if h.startswith(how)) for how in ("made", "carried in")}
            for quantity, counts in entry["counts"].items() if set(counts) != {"equal"}}


def test_the_trainer_refed_from_the_megatron_loop_gives_the_builtin_refeeds_result(compared, tmp_path):
    report, requests = compared["forward"]
    megatron = run_example("megatron_loop.py", requests["a"], tmp_path / "megatron")
    trainer = run_example("hf_trainer.py", requests["b"], tmp_path / "trainer")
    state = tmp_path / "state"
    assert subprocess.run([sys.executable, "-m", "harness", "state-for", str(megatron), "--step", "1", "--as",
                           str(trainer), "--out", str(state)], cwd=REPO_ROOT).returncode == 0
    refed = run_example("hf_trainer.py", requests["b"], tmp_path / "refed", "--state-from", str(state))
    assert_builtin_result(megatron, trainer, refed, report, tmp_path)


def test_the_megatron_loop_with_the_distributed_optimizer_refed_gives_the_builtin_refeeds_result(compared, tmp_path):
    report, requests = compared["backward"]
    megatron = run_example("megatron_loop.py", requests["b"], tmp_path / "megatron")
    train = json.loads((megatron / "meta.json").read_text())["capture"]["config"]["train"]
    assert train["distributed_optimizer"] and train["weight_decay_params"] == "not_1d"  # read through its ranges
    state_for.write(megatron, 1, megatron, tmp_path / "own")
    again = run_example("megatron_loop.py", requests["b"], tmp_path / "again", "--state-from", str(tmp_path / "own"))
    result, _ = compare_runs(megatron, again, reports_dir=tmp_path)
    assert result.verdict == "BITWISE_PASS", result.message  # its own state put back through its ranges: no bit moved
    trainer = run_example("hf_trainer.py", requests["a"], tmp_path / "trainer")
    state_for.write(trainer, 1, megatron, tmp_path / "theirs")
    refed = run_example("megatron_loop.py", requests["b"], tmp_path / "refed", "--state-from", str(tmp_path / "theirs"))
    assert_builtin_result(trainer, megatron, refed, report, tmp_path)


def assert_builtin_result(a: Path, b: Path, refed: Path, report: dict, tmp_path: Path) -> None:
    """compare-runs A B --refed R attributes step 2's differences as the built-in re-feed of `report` does."""
    result, run_dir = compare_runs(a, b, refed=refed, reports_dir=tmp_path)
    mine = json.loads((run_dir / "report.json").read_text())["train"]["refed"]
    assert result.verdict == "DIFF" and mine["status"] == "ok", (result.message, mine)
    builtin = report["train"]["refeed"]["steps"][1]
    ours = made_and_carried(mine["steps"][0])
    ours.pop("grad_norm", None)  # the Trainer computes a norm without clipping, hf_model's runner none
    assert ours == made_and_carried(builtin), (ours, builtin["attribution"])
    assert any(counts["made"] for counts in ours.values()) and any(c["carried in"] for c in ours.values())
    for quantity, names in builtin["made"].items():  # the same tensors (the first ten of each quantity)
        assert mine["steps"][0]["made"][quantity] == names, quantity


PADDLE_LOOPS = REPO_ROOT / "tests" / "support" / "paddle_loops.py"


def paddle_run(mode: str, out: Path, *state) -> Path:
    """tests/support/paddle_loops.py's `mode` in its own process: its recorded run's folder."""
    done = subprocess.run([sys.executable, str(PADDLE_LOOPS), mode, str(out), *map(str, state)],
                          env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "run"


PLANTED = "step1.exp_avg_sq.model.layers.0.self_attn.k_proj.weight"  # canonical [out, in]; Paddle's is [in, out]


@pytest.mark.parametrize("kind", ["loop", "trainer"])
def test_a_paddle_run_loads_each_bit_of_a_state_where_it_belongs(kind, tmp_path):
    """A Paddle dygraph loop and PaddleFormers' Trainer (tiny GLM-4.5 MoE, 3 steps; most routed experts get no
    gradient, so Paddle holds no optimizer state for them), re-fed at step 2 from their own state after step 1 with
    one bit of one second moment flipped (element [1, 2] of k_proj's, a weight Paddle holds transposed): at step 2
    only that moment element and the parameter element it updates differ from the plain run (the second moment
    does not reach the forward), every other tensor of steps 1 and 2 is the plain run's (the load through Paddle's
    names, transposes and accumulators, and the lr through the loop's optimizer or the Trainer's scheduler, moved no
    other bit); and compare-runs' own check calls such a re-fed run unfaithful."""
    if absent("paddle", "paddleformers"):
        pytest.skip("needs paddle and paddleformers")
    plain = paddle_run(f"{kind}-recorded", tmp_path / "plain")
    state_for.write(plain, 1, plain, tmp_path / "state")
    tensorfile.flip_bit(tmp_path / "state" / "steps" / "step00001.safetensors", PLANTED, (1, 2), 21)
    refed = paddle_run(f"{kind}-refed", tmp_path / "refed", tmp_path / "state")
    result, run_dir = compare_runs(plain, refed, reports_dir=tmp_path)
    differing = {t["name"]: t for t in json.loads((run_dir / "report.json").read_text())["tensors"]
                 if t["status"] != "EQUAL" and not t["name"].startswith("step3.")}
    moment, param = PLANTED.replace("step1.", "step2."), PLANTED.replace("step1.exp_avg_sq.", "step2.param.")
    assert result.verdict == "DIFF" and set(differing) == {moment, param}, (result.message, list(differing))
    assert [(differing[n]["mismatches"], differing[n]["first_mismatch"]["index"]) for n in (moment, param)] == \
        [(1, [1, 2])] * 2
    result, run_dir = compare_runs(plain, plain, refed=refed, reports_dir=tmp_path)
    said = json.loads((run_dir / "report.json").read_text())["train"]["refed"]
    assert said["status"] == "unfaithful" and f"2 tensors differ from run B's, first {moment}" in said["reason"], said
