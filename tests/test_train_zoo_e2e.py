"""The training level end to end on the model zoo's families (issue 34) but DeepSeek-V3 and GLM-4.5 (whose training
tests/test_train_e2e.py runs): the registry's training cases (cases/<family>_train.toml, found by what each states:
tests/support/zoo.py, so a new family's run here without an edit) at E2E_TOKENS (16), each side in its own training
code (docs/training.md has the measurements).

- Each pair gives DIFF at every step and parts first at step 1 (the routers and the core attention round apart by
  construction: cases/<family>.toml); the tensor it parts at the family's tests pin on the platform it was measured
  on (AMD EPYC with AVX-512 BF16), and where this platform's baseline records the pair, the run repeats the record
  (every differing tensor's counts and each side's bits).
- The negative controls (a flipped bit of an Adam moment) are found at exactly their tensors and step.
- The float64 check of every step passes for every pair the stacks can run.
- A stack trained against itself (a family only one stack trains here) is bitwise equal at every step.
- A pair a stack cannot run (a family PaddleFormers has no dygraph model of) is UNSUPPORTED, as its case states.
"""

import json

import pytest

from conftest import E2E_TOKENS
from harness import CompareOptions, compare_case
from harness.case.registry import Registry
from harness.families import family_of
from harness.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from tests.support import zoo
from tests.support.e2e import assert_repeats_the_record, committed_record

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("runner_workers")]

CASES = zoo.zoo_cases("causal_lm_train", but=("glm4_moe",))  # GLM-4.5's: tests/test_train_e2e.py
PAIRS = [case.name for case in CASES if case.train.flip is None and case.dtype != "float64"
         and case.runners[0] != case.runners[1] and case.train.record.name == DEFAULT_OPTIMIZER
         and case.expect.verdict == "DIFF"]
SELF = [case.name for case in CASES if case.train.flip is None and case.dtype != "float64"
        and case.runners[0] == case.runners[1]]
CONTROLS = [case.name for case in CASES if case.train.flip is not None]
FLOAT64 = zoo.float64_pairs(CASES)
UNSUPPORTED = [case.name for case in CASES if case.expect.verdict == "UNSUPPORTED"]


def _run(name, tmp_path, checkpoints_dir, **options):
    result, run_dir = compare_case(name, CompareOptions(tokens=E2E_TOKENS, checkpoints_dir=checkpoints_dir,
                                                        reports_dir=tmp_path / "reports", **options))
    report = json.loads((run_dir / "report.json").read_text())
    tails = "\n".join(s.get("stderr_tail", "")[-2500:] for s in report["sides"] if s["status"] != "ok")
    return result, run_dir, report, tails


@pytest.mark.parametrize("case", PAIRS)
def test_zoo_training_pairs_part_at_step_1(case, tmp_path, checkpoints_dir):
    """Megatron-Core vs HF or PaddleFormers: DIFF at every step, first at step 1; the lr equal at every step; at step
    1 (lr 0) every parameter equal; the gradients numerically equal at a step are idle experts' zeros; a routing bias
    (a buffer of the family's layout) equal at every step (no stack moves it), none where the family has none."""
    stated = Registry.load().get(case)
    parameters = len(family_of(stated.model.family).gradients(stated.model))
    bias = bool(family_of(stated.model.family).buffers(stated.model))
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, tails)
    train = report["train"]
    assert train["parameters"] == parameters and [s["verdict"] for s in train["steps"]] == ["DIFF"] * 3
    assert train["first_divergence"]["step"] == 1, train["first_divergence"]
    for step in train["steps"]:
        assert step["scalars"]["lr"]["equal"]
        assert ("expert_bias" in step["quantities"]) == bias
        if bias:
            assert step["quantities"]["expert_bias"]["differing"] == []
        grads = [t for t in report["tensors"] if t["name"].startswith(f"step{step['step']}.grad.")]
        zeros = {t["name"] for t in grads if t["status"] == "EQUAL" or not t["max_abs_error"]}
        assert zeros and all(".mlp.experts." in name for name in zeros), sorted(zeros)[:5]
    assert train["steps"][0]["quantities"]["param"]["equal"] == parameters
    known, table = committed_record(stated)
    if known is not None:
        assert_repeats_the_record(stated, report, table)
    zoo.check_run(stated, report, run_dir)


@pytest.mark.parametrize("case", CONTROLS)
def test_zoo_training_control_is_found_at_its_tensors(case, tmp_path, checkpoints_dir):
    """One bit of an Adam moment flipped on side b after step 1 (the case's flip): step 1 bitwise, at step 2 exactly
    that moment (one element, at the flip's index) and that parameter, at step 3 the gradients (the case's
    expectation); the re-feed says both were carried in at step 2."""
    stated = Registry.load().get(case)
    flip = stated.train.flip
    tensor = flip.tensor
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False, refeed_ops=True)
    assert result.verdict == "DIFF" and result.expectation["met"] and result.exit_code == 0, (
        result.message, result.expectation, tails)
    assert [s["verdict"] for s in report["train"]["steps"]] == ["BITWISE_PASS", "DIFF", "DIFF"]
    rows = {t["name"]: t for t in report["tensors"]}
    assert {n for n, t in rows.items() if n.startswith("step2.") and t["mismatches"]} == {
        f"step2.{flip.state}.{tensor}", f"step2.param.{tensor}"}
    flipped = rows[f"step2.{flip.state}.{tensor}"]
    assert flipped["mismatches"] == 1 and flipped["first_mismatch"]["index"] == list(flip.index)
    assert rows[f"step2.param.{tensor}"]["mismatches"] == 1
    assert rows[f"step3.grad.{tensor}"]["mismatches"]
    parameters = report["train"]["parameters"]
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok" and refeed["steps"][1]["attribution"] == {
        flip.state: f"1 carried in, {parameters - 1} equal", "param": f"1 carried in, {parameters - 1} equal"}, refeed
    zoo.check_run(stated, report, run_dir)


@pytest.mark.parametrize("case", SELF)
def test_zoo_training_stack_against_itself_is_bitwise(case, tmp_path, checkpoints_dir):
    """A stack trained against itself (GLM-5: only transformers trains it here): every state tensor of every step
    bitwise equal, as the case states; every trained parameter counted (the family's gradients)."""
    stated = Registry.load().get(case)
    parameters = len(family_of(stated.model.family).gradients(stated.model))
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "BITWISE_PASS" and result.expectation["met"], (result.message, tails)
    train = report["train"]
    assert train["parameters"] == parameters and [s["verdict"] for s in train["steps"]] == ["BITWISE_PASS"] * 3
    zoo.check_run(stated, report, run_dir)


@pytest.mark.parametrize("case, runners, unsupported", FLOAT64, ids=[f"{c}-{'-vs-'.join(p)}" for c, p, _ in FLOAT64])
def test_zoo_float64_check_judges_every_step(case, runners, unsupported, tmp_path, checkpoints_dir):
    """The float64 check of every step (plain run, re-fed, optimizer on side a's gradients): every pair within the
    floors its stacks state in the family's name map, the q/k/v parts of the fused tensors and the q/k norms
    included; a stack against itself bitwise equal."""
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False, runners=runners)
    if unsupported:
        assert result.verdict == "UNSUPPORTED" and unsupported in result.message, (result.message, tails)
        return
    semantic = report["train"].get("semantic")
    assert semantic, (result.verdict, result.message, tails)
    assert semantic["ok"], f"mapping error: {semantic['first_mismatch']}: {semantic['tensors_beyond'][:3]}"
    # a stack against itself (GLM-5's and Qwen3.5-MoE's HF pairs) gives equal bits; two stacks are within the floors
    assert result.verdict == ("BITWISE_PASS" if runners[0] == runners[1] else "WITHIN_TOLERANCE"), result.message
    assert report["train"]["refeed"]["status"] == "ok", result.message
    assert [part["checked"] > 0 for part in semantic["parts"]] == [True] * 3
    zoo.check_run(Registry.load().get(case), report, run_dir)


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_zoo_training_pair_a_stack_cannot_run_is_unsupported(case, tmp_path, checkpoints_dir):
    """A pair the case states UNSUPPORTED (PaddleFormers without a dygraph model of the family) is, naming why."""
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "UNSUPPORTED" and result.expectation["met"], (result.message, tails)
    zoo.check_run(Registry.load().get(case), report, run_dir)


# Families no other stack trains here: their HF run is the reference a user's own captured run is compared against
# (docs/model.md). DeepSeek-V4 at its case's 16 tokens, which its compression rates are sized for.
REFERENCES = {"deepseek_v32_2layer_train": E2E_TOKENS, "deepseek_v4_2layer_train": None}


@pytest.mark.parametrize("case", sorted(REFERENCES))
def test_an_hf_only_familys_training_run_is_a_reference_compare_runs_reads(case, tmp_path, checkpoints_dir):
    """The training case's side folders are step folders that compare-runs reads: every step BITWISE_PASS against
    the other HF side (the same code and kernels), the float64 truth following AdamW at every step."""
    from harness.cli import main

    result, run_dir = compare_case(case, CompareOptions(
        tokens=REFERENCES[case], checkpoints_dir=checkpoints_dir, reports_dir=tmp_path / "reports"))
    assert (result.verdict, result.exit_code) == ("BITWISE_PASS", 0), result.message
    runs = [run_dir / name for name in ("a-hf_model", "b-hf_model", "oracle-hf_model-float64")]
    assert main(["compare-runs", str(runs[0]), str(runs[1]), "--truth", str(runs[2]), "--reports",
                 str(tmp_path / "runs")]) == 0
    [folder] = (tmp_path / "runs").iterdir()
    report = json.loads((folder / "report.json").read_text())
    assert report["verdict"] == "BITWISE_PASS" and [s["verdict"] for s in report["train"]["steps"]] == [
        "BITWISE_PASS"] * 3
