"""Training across ranks end to end on the CPU (docs/training-ranks.md): every side here runs on 2 ranks under its
framework's launcher (torchrun, paddle.distributed.launch; gloo on loopback), so each test starts 2 processes per side
(marked `ranks`). Tiny 2-layer DeepSeek-V3 (8 experts top-2), 2 steps of 2 micro-batches: one per rank at DP=2.

- Each stack at DP=2 against itself at DP=1 on the same global batch: the report's invariance lists are exactly what
  the two sides' step files say, bit for bit; every rank ended every step with rank 0's state; the lr, and at step 1
  the loss and the gradients, are bitwise equal (each micro-batch's forward and backward is the same computation on
  another rank, its gradient scaled by 1/2 there instead of through the loss, and a sum of two gradients is the same
  in either order).
- Megatron at EP=2 against EP=1 (both DP=2): the other rank's experts come back whole, and the lists match the files.
- The negative control on ranks: one planted bit, in a distributed optimizer's range or in the other expert-parallel
  rank's expert, reaches exactly its exp_avg and parameter at step 2.
- Megatron against HF, both at DP=2, gives per-step verdicts and the float64 truth (on one rank) per step.
- PaddleFormers' expert parallel is UNSUPPORTED on this machine, naming DeepEP's package.
"""


import numpy as np
import pytest
from safetensors import safe_open

from harness.compare.train import ORDER
from tests.support.cases import write_cases
from tests.support.train import TINY_TRAIN, run_train_case, tiny_train_case

pytestmark = [pytest.mark.e2e, pytest.mark.ranks]

Q_A = "model.layers.0.self_attn.q_a_proj.weight"
EXPERT_5 = "model.layers.1.mlp.experts.5.down_proj.weight"  # on expert-parallel rank 1 of 2 (8 experts)
RANKED = {**TINY_TRAIN, "dp": 2}


def flip(tensor):
    return {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": tensor, "index": [5, 7], "bit": 20}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    same = {r: [r, r] for r in ("megatron_model", "hf_model", "paddle_model")}
    return write_cases(tmp_path_factory.mktemp("rank-cases"), *[
        tiny_train_case("t_megatron", runners=same["megatron_model"], train=RANKED),
        tiny_train_case("t_megatron_distopt", runners=same["megatron_model"],
                        train={**RANKED, "distributed_optimizer": True}),
        tiny_train_case("t_hf", runners=same["hf_model"], train=RANKED),
        tiny_train_case("t_paddle", runners=same["paddle_model"], train=RANKED),
        tiny_train_case("t_megatron_ep", runners=same["megatron_model"], train={**RANKED, "ep": 2}),
        *[tiny_train_case(f"t_control_{i}", runners=same["megatron_model"],
                          train={**RANKED, "ep": 2, "distributed_optimizer": True, "flip": flip(tensor)})
          for i, tensor in enumerate((Q_A, EXPERT_5))],
        tiny_train_case("t_megatron_hf", train=RANKED),
        tiny_train_case("t_paddle_ep", runners=same["paddle_model"], train={**RANKED, "ep": 2}),
    ])



def _tensors(path):
    with safe_open(str(path), framework="numpy") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _first_departures(report, steps):
    """{quantity: first step whose files differ in it}, from the two sides' step files themselves."""
    folders = [side["folder"] for side in report["sides"][:2]]
    departs = {}
    for step in range(1, steps + 1):
        a, b = (_tensors(f"{folder}/steps/step{step:05d}.safetensors") for folder in folders)
        assert set(a) == set(b)
        for name in a:
            if a[name].tobytes() != b[name].tobytes():
                departs.setdefault(name.split(".")[1], step)
    return departs


def _check_ranked_side(side, ranks=2):
    assert side["meta"]["launch"]["ranks"] == ranks, side["meta"].get("launch")
    agree = side["meta"]["ranks_agree"]
    assert agree["ranks"] == ranks and agree["checked"] > 0 and agree["differing_count"] == 0, agree


@pytest.mark.parametrize("name", ["t_megatron", "t_megatron_distopt", "t_hf", "t_paddle"])
def test_a_stack_at_dp2_against_itself_at_dp1(name, cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case(name, cases, tmp_path, checkpoints_dir, versus_dp=1, oracle=False)
    assert result.verdict in ("BITWISE_PASS", "DIFF"), (result.message, tails)
    a, b = report["sides"][:2]
    _check_ranked_side(a)
    assert "launch" not in b["meta"] and a["meta"]["data_parallel"] == 2 and b["meta"]["data_parallel"] == 1
    comparison = report["comparison"]
    assert (comparison["kind"], comparison["dp_a"], comparison["dp_b"]) == ("data_parallel", 2, 1)
    departs = _first_departures(report, 2)
    assert comparison["departs"] == {q: departs[q] for q in ORDER if q in departs}
    assert set(comparison["bitwise"]) == {q for q in ORDER if q not in departs and q != "master"}
    assert "lr" in comparison["bitwise"] and departs.get("loss", 3) > 1
    assert departs.get("grad", 3) > 1, "a sum of two gradients is the same in either order"
    assert "DP-invariant (bitwise equal at every step)" in (run_dir / "report.md").read_text()


def test_megatron_at_ep2_against_ep1(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_megatron_ep", cases, tmp_path, checkpoints_dir, versus_ep=1,
                                          oracle=False)
    assert result.verdict in ("BITWISE_PASS", "DIFF"), (result.message, tails)
    a, b = report["sides"][:2]
    _check_ranked_side(a)
    _check_ranked_side(b)
    assert (a["meta"]["expert_parallel"], b["meta"]["expert_parallel"]) == (2, 1)
    assert "expert_model_parallel_size 2" in a["meta"]["knobs"]["moe_token_dispatcher_type"]
    steps = _tensors(f"{a['folder']}/steps/step00002.safetensors")
    for expert in range(8):  # both expert-parallel ranks' experts, whole
        assert steps[f"step2.param.model.layers.1.mlp.experts.{expert}.gate_up_proj.weight"].shape == (32, 64)
    departs = _first_departures(report, 2)
    assert report["comparison"]["departs"] == {q: departs[q] for q in ORDER if q in departs}


@pytest.mark.parametrize("name, tensor", [("t_control_0", Q_A), ("t_control_1", EXPERT_5)])
def test_the_negative_control_on_ranks_is_found_at_its_step_in_its_parameter(name, tensor, cases, tmp_path,
                                                                            checkpoints_dir):
    result, run_dir, report, tails = run_train_case(name, cases, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    for side in report["sides"][:2]:
        _check_ranked_side(side)
    step1, step2 = report["train"]["steps"]
    assert step1["verdict"] == "BITWISE_PASS"
    differing = {t["name"] for t in report["tensors"] if t["status"] != "EQUAL" and t["name"].startswith("step2.")}
    assert differing == {f"step2.exp_avg.{tensor}", f"step2.param.{tensor}"}
    exp_avg = next(t for t in report["tensors"] if t["name"] == f"step2.exp_avg.{tensor}")
    assert exp_avg["mismatches"] == 1 and exp_avg["first_mismatch"]["index"] == [5, 7]


def test_megatron_against_hf_both_at_dp2_gives_per_step_verdicts_and_the_truth(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_megatron_hf", cases, tmp_path, checkpoints_dir)
    assert result.verdict in ("BITWISE_PASS", "DIFF"), (result.message, tails)
    for side in report["sides"][:2]:
        _check_ranked_side(side)
    truth = report["sides"][2]
    assert truth["label"] == "oracle" and "launch" not in truth["meta"] and truth["meta"]["data_parallel"] == 1
    for step in report["train"]["steps"]:
        assert step["verdict"] in ("BITWISE_PASS", "DIFF") and set(step["truth"]) >= {"grad", "param"}
    losses = [_tensors(f"{s['folder']}/steps/step00001.safetensors")["step1.loss"] for s in report["sides"]]
    assert all(loss.shape == (2,) for loss in losses)
    np.testing.assert_allclose(losses[0], losses[2], rtol=1e-5)  # each micro-batch's share, in global order


def test_paddleformers_expert_parallel_is_unsupported_naming_deep_ep(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_paddle_ep", cases, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "UNSUPPORTED", (result.message, tails)
    assert "paddlefleet_ops.deep_ep" in report["sides"][0]["reason"]
    assert report["sides"][0]["meta"]["launch"]["ranks"] == 2
