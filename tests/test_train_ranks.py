"""Training across ranks without starting any (docs/training-ranks.md): the `dp` and `ep` fields and their refusals,
which micro-batches each rank trains, the launch commands, the check that every rank ends a step with rank 0's state,
how a tensor held in pieces is put back together, the invariance summary, and the command line's refusals (each
before any runner starts)."""

import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from harness import CompareOptions, Versus, compare_case
from harness.case.registry import CaseError, Registry
from harness.case.train_settings import rank_micro_batches
from harness.compare.train_steps import invariance
from harness.run import launch
from harness.run.steps import StepWriter, ranks_agree, step_file
from tests.support.cases import registry_from, tiny_case, write_cases
from tests.support.train import TINY_MODEL, TINY_TRAIN, tiny_train_case


def test_dp_and_ep_default_to_one_rank():
    train = Registry.load().get("kimi_k2_2layer_train").train
    assert (train.dp, train.ep) == (1, 1)
    ranked = Registry.load().get("kimi_k2_2layer_train_control_megatron_ranks").train
    assert (ranked.dp, ranked.ep, ranked.distributed_optimizer) == (2, 2, True)


@pytest.mark.parametrize("train, model, field, why", [
    ({"dp": 3}, {}, "train.dp", "must be one of 1, 2, 4, 8"),
    ({"dp": 4}, {}, "train.dp", r"must divide micro_batches \(2\)"),
    ({"ep": 2}, {}, "train.ep", r"must divide dp \(1\)"),
    ({"dp": 2, "ep": 0}, {}, "train.ep", "must be one of 1, 2, 4, 8"),
    ({"dp": 4, "ep": 4, "micro_batches": 4}, {"n_routed_experts": 6}, "train.ep",
     r"must divide the model's routed experts \(6\)"),
])
def test_bad_rank_counts_name_file_case_field_and_value(tmp_path, train, model, field, why):
    (tmp_path / "bad.toml").write_text(tiny_train_case("bad", train={**TINY_TRAIN, **train},
                                                       config={"model": {**TINY_MODEL, **model}}))
    with pytest.raises(CaseError, match=f"bad.toml: case 'bad': field '{field}': {why}"):
        Registry.load(tmp_path)


def test_each_rank_trains_every_dp_th_micro_batch_of_the_global_batch():
    assert rank_micro_batches(4, 2, 0) == [0, 2] and rank_micro_batches(4, 2, 1) == [1, 3]
    assert rank_micro_batches(2, 1, 0) == [0, 1]
    taken = sorted(mb for rank in range(4) for mb in rank_micro_batches(8, 4, rank))
    assert taken == list(range(8))


@pytest.mark.parametrize("runner, launcher", [("megatron_model", "torch.distributed.run"),
                                              ("hf_model", "torch.distributed.run"),
                                              ("paddle_model", "paddle.distributed.launch")])
def test_a_training_side_on_two_ranks_starts_under_its_framework_launcher(tmp_path, runner, launcher):
    command, info = launch.command(runner, "/py", tmp_path / "request.json", 1, tmp_path, dp=2)
    assert command[:3] == ["/py", "-m", launcher] and "2" in command
    assert command[-4:] == ["-m", f"harness.runners.{runner}", "--request", str(tmp_path / "request.json")]
    assert (info["tp"], info["dp"], info["ranks"]) == (1, 2, 2)
    alone, info = launch.command(runner, "/py", tmp_path / "request.json", 1, tmp_path, dp=1)
    assert alone[:2] == ["/py", "-m"] and info == {"launcher": "none", "tp": 1}


def _steps(folder, tensors_by_rank, kept=(1,), pieces_by_rank=None):
    """One step file per rank through the real writer (rank 0 whole where kept, every other rank digests)."""
    for rank, tensors in enumerate(tensors_by_rank):
        writer = StepWriter(folder, kept, lambda t, path, meta: save_file(t, path, meta),
                            lambda a: np.ascontiguousarray(a).view(np.uint8), rank)
        writer.write(1, {"lr": np.array(1e-3)}, tensors, (pieces_by_rank or {}).get(rank))


@pytest.fixture
def one_step_case(tmp_path):
    return registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps": 1, "decay_steps": 1})) \
        .get("tiny_train")


@pytest.mark.parametrize("kept", [(1,), ()])
def test_a_rank_whose_state_differs_from_rank_0_is_named(tmp_path, one_step_case, kept):
    state = {"param.w": np.arange(6, dtype=np.float32), "exp_avg.w": np.ones(6, dtype=np.float32)}
    changed = {**state, "exp_avg.w": state["exp_avg.w"].copy()}
    changed["exp_avg.w"][4] = np.nextafter(np.float32(1), np.float32(2))
    reshaped = {**state, "param.w": state["param.w"].reshape(2, 3)}  # the same bytes in another shape
    _steps(tmp_path / "same", [state, state], kept)
    _steps(tmp_path / "other", [state, changed], kept)
    _steps(tmp_path / "reshaped", [state, reshaped], kept)
    assert ranks_agree(tmp_path / "same", one_step_case, 2) == {"ranks": 2, "checked": 3, "differing": [],
                                                                "differing_count": 0, "departures": {}}
    other = ranks_agree(tmp_path / "other", one_step_case, 2)
    assert other["differing"] == ["step1.exp_avg.w (rank 1)"]
    assert other["departures"] == {"1": {"step": 1, "tensors": 1, "first": "step1.exp_avg.w"}}
    assert ranks_agree(tmp_path / "reshaped", one_step_case, 2)["differing"] == ["step1.param.w (rank 1)"]
    step_file(tmp_path / "other", 1, 1).unlink()
    assert ranks_agree(tmp_path / "other", one_step_case, 2)["problem"].endswith(
        "step00001.rank1.safetensors is missing")


@pytest.mark.parametrize("kept", [(1,), ()])
def test_a_piece_that_is_not_where_rank_0_has_it_is_found(tmp_path, one_step_case, kept):
    """Issue 29, finding 4: each rank digests its own piece (a distributed optimizer's range, its experts) before any
    gather, and the check holds it against the same place of rank 0's canonical tensor: from rank 0's kept tensor,
    or from the digests of those places rank 0 writes on a digest-only step."""
    canonical = np.arange(6, dtype=np.float32)
    state = {"exp_avg.w": canonical}

    def run(name, piece, place=(3, 6)):
        rank0 = {"exp_avg.w": [(3, 6, canonical[3:6])]}  # rank 0: the place rank 1 holds, from its own tensor
        _steps(tmp_path / name, [state, {}], kept, {0: rank0, 1: {"exp_avg.w": [(*place, piece)]}})
        return ranks_agree(tmp_path / name, one_step_case, 2)

    assert run("same", canonical[3:6].copy())["departures"] == {}
    off = canonical[3:6].copy()
    off[1] = np.nextafter(off[1], np.float32(9))
    assert run("off", off)["departures"] == {"1": {"step": 1, "tensors": 1, "first": "step1.exp_avg.w[3:6]"}}
    elsewhere = run("elsewhere", canonical[3:6].copy(), (2, 5))  # the right values in the wrong place
    if kept:
        assert elsewhere["differing"] == ["step1.exp_avg.w[2:5] (rank 1)"]
    else:
        assert elsewhere["problem"].endswith("has nothing to check "
                                             f"{step_file(tmp_path / 'elsewhere', 1, 1)}'s step1.exp_avg.w elements "
                                             "2:5 against")
    assert run("as_int", canonical[3:6].view(np.int32))["differing"] == ["step1.exp_avg.w[3:6] (rank 1)"]


def _side(label="a", meta=None, runner="megatron_model"):
    from harness.run.orchestrate import SideResult

    return SideResult(label, runner, "ok", Path("/nowhere"), "python", meta=meta or {})


DEPARTED = {"ranks_agree": {"ranks": 2, "checked": 9, "differing": ["step2.param.x (rank 1)"], "differing_count": 1,
                            "departures": {"1": {"step": 2, "tensors": 3, "first": "step2.param.x"}}}}


def test_ranks_that_disagree_make_the_verdict_diff_with_the_rank_named():
    """Issue 29, finding 4: a departure between a side's ranks was a note under BITWISE_PASS."""
    from harness.compare.result import decide
    from harness.compare.tensors import DIFF, EQUAL, TensorComparison

    equal = [TensorComparison("step1.lr", EQUAL), TensorComparison("step2.param.x", EQUAL)]
    assert decide([_side(), _side("b")], equal) == ("BITWISE_PASS", "all 2 tensors bitwise equal")
    verdict, message = decide([_side(meta=DEPARTED), _side("b")], equal)
    assert (verdict, message) == ("DIFF", "side a (megatron_model): rank 1 departs from rank 0 at step 2 in 3 state "
                                          "tensors (first: step2.param.x)")
    differing = [TensorComparison("step1.lr", EQUAL), TensorComparison("step2.param.x", DIFF)]
    verdict, message = decide([_side(meta=DEPARTED), _side("b")], differing)
    assert verdict == "DIFF" and message.endswith("(first: step2.param.x); 1 of 2 tensors differ: step2.param.x")
    gather = {"gather": {"out": {"split_dim": 1}, "grad.input": {
        "replicated": True, "identical_across_ranks": False, "mismatches_vs_rank0": {"1": 4},
        "ranks_with_other_shape": []}}}
    assert decide([_side(), _side("b", gather, "paddle")], [TensorComparison("out", EQUAL)]) == (
        "DIFF", "side b (paddle): rank 1 departs from rank 0 in 1 replicated tensor (first: grad.input)")
    within = {"within": True, "tensors": []}
    assert decide([_side(meta=DEPARTED)], differing, tolerance=within)[0] == "DIFF"


def test_the_expectation_says_whether_ranks_agree():
    from harness.case.registry import Expectation
    from harness.compare.expectation import check_expectation
    from harness.compare.result import rank_departures
    from harness.compare.tensors import EQUAL, TensorComparison

    tensors = [TensorComparison("step1.lr", EQUAL)]
    departed = rank_departures([_side(meta=DEPARTED)])
    assert check_expectation(Expectation("BITWISE_PASS"), "BITWISE_PASS", tensors, [])["met"]
    unmet = check_expectation(Expectation("DIFF"), "DIFF", tensors, departed)
    assert unmet["problems"] == [f"ranks were expected to agree: {departed[0]}"]
    # a case that states nothing (stated=False) lists no verdict problem, but a rank departure still fails it
    unstated = check_expectation(Expectation("BITWISE_PASS"), "BITWISE_PASS", tensors, departed)
    assert not unstated["met"] and unstated["problems"] == [f"ranks were expected to agree: {departed[0]}"]
    assert check_expectation(Expectation("DIFF", ranks_agree=False), "DIFF", tensors, departed)["met"]
    agreed = check_expectation(Expectation("BITWISE_PASS", ranks_agree=False), "BITWISE_PASS", tensors, [])
    assert agreed["problems"] == ["a side's ranks were expected to end a step with other state than its rank 0 "
                                  "(expect.ranks_agree = false); every rank agreed with rank 0"]


def test_a_tensor_held_in_pieces_is_put_back_together_or_refused():
    torch = pytest.importorskip("torch")
    from harness.runners.torch.ranks import assemble

    whole = torch.arange(12, dtype=torch.float32).view(3, 4)
    flat = whole.view(-1)
    assert torch.equal(assemble("w", (3, 4), [(5, 12, flat[5:]), (0, 5, flat[:5])]), whole)
    with pytest.raises(RuntimeError, match="w: the ranks' pieces cover 10 of its 12 elements"):
        assemble("w", (3, 4), [(0, 5, flat[:5]), (5, 10, flat[5:10])])
    with pytest.raises(RuntimeError, match="do not tile"):
        assemble("w", (3, 4), [(0, 6, flat[:6]), (5, 12, flat[5:])])


def test_a_piece_travels_without_the_buffer_it_is_a_view_of(monkeypatch):
    """Pickling a view pickles its whole storage: a distributed optimizer's range of Megatron's flat gradient buffer
    would carry the whole buffer, once per parameter (measured: a rank killed for memory at 384 experts)."""
    torch = pytest.importorskip("torch")
    from harness.runners.torch import ranks

    sent = []
    monkeypatch.setattr(ranks, "to_rank0", lambda value, group: sent.append(value) or [value])  # a one-rank double
    buffer = torch.arange(1000, dtype=torch.float32)
    whole, places = ranks.gather_pieces({"w": [(0, 6, buffer[10:16])]}, {"w": (2, 3)}, "group", "cpu")
    assert torch.equal(whole["w"], buffer[10:16].view(2, 3)) and places == {}
    piece = sent[0]["w"][0][2]
    assert piece.untyped_storage().nbytes() == 6 * 4


def test_the_losses_come_back_in_global_micro_batch_order(monkeypatch):
    torch = pytest.importorskip("torch")
    from harness.runners.torch import ranks

    # a test double of the collective: what two ranks hold (rank r trained micro-batches r and r + 2)
    monkeypatch.setattr(ranks, "everyone", lambda value, group: [torch.tensor([0.5, 2.5]), torch.tensor([1.5, 3.5])])
    assert ranks.global_losses(torch.tensor([0.5, 2.5]), 2, group="two ranks").tolist() == [0.25, 0.75, 1.25, 1.75]
    assert ranks.global_losses(torch.tensor([0.5, 2.5]), 1, group=None).tolist() == [0.5, 2.5]


def test_invariance_names_what_stays_bitwise_and_the_step_each_quantity_departs_at():
    def step(k, scalars_equal, grads_equal):
        return {"step": k, "scalars": {q: {"equal": q in scalars_equal} for q in
                                       ("lr", "loss", "grad_norm", "clip_coeff")},
                "quantities": {"grad": {"equal": grads_equal, "total": 3}, "param": {"equal": 3, "total": 3}}}

    summary = {"steps": [step(1, {"lr", "loss", "clip_coeff"}, 3), step(2, {"lr"}, 1)],
               "order": ["lr", "loss", "grad", "grad_norm", "clip_coeff", "exp_avg", "param"]}
    assert invariance(summary) == {"bitwise": ["lr", "param"],
                                   "departs": {"loss": 2, "grad": 2, "grad_norm": 1, "clip_coeff": 2}}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return write_cases(tmp_path_factory.mktemp("rank-cases"), tiny_train_case("t_train"),
                       tiny_train_case("t_megatron", runners=["megatron_model", "megatron_model"]),
                       tiny_train_case("t_flip_rank", runners=["megatron_model", "megatron_model"],
                                       train={**TINY_TRAIN, "dp": 2, "flip": {
                                           "side": "b", "after_step": 1, "state": "param", "index": [0, 0],
                                           "tensor": "lm_head.weight", "bit": 3, "rank": 1}}),
                       tiny_case("t_linear"))


@pytest.mark.parametrize("name, options, message", [
    ("t_linear", {"dp": 2}, "--dp is for training cases"),
    ("t_linear", {"versus": Versus("dp", 1)}, "--versus dp: op-level cases take --versus tp, impl"),
    ("t_train", {"dp": 4}, r"--dp / --ep: train.dp must divide micro_batches \(2\)"),
    ("t_train", {"dp": 2, "ep": 2}, "train.ep = 2: runner 'hf_model' has no expert-parallel MoE layer"),
    ("t_megatron", {"versus": Versus("dp", 1)}, "--versus dp=1 is side a's dp already"),
    ("t_megatron", {"versus": Versus("ep", 2)}, r"--versus ep: train.ep must divide dp \(1\)"),
    ("t_megatron", {"dp": 2, "refeed_ops": True}, "--refeed re-runs one rank's training"),
    ("t_flip_rank", {"versus": Versus("dp", 1)}, r"tiny.toml: case 't_flip_rank': train.flip.rank must be a "
                                      r"data-parallel rank of side b, which trains on dp = 1 \(got 1\)"),
])
def test_the_command_line_refuses_rank_counts_before_any_runner_starts(cases, tmp_path, name, options, message):
    result, run_dir = compare_case(name, CompareOptions(cases_dir=cases, checkpoints_dir=tmp_path / "checkpoints",
                                                        reports_dir=tmp_path / "reports", **options))
    assert result.verdict == "ERROR" and not result.sides, result.message
    assert re.search(message, result.message), result.message


def test_versus_names_one_axis():
    with pytest.raises(ValueError, match="Versus.axis must be one of tp, impl, dp, ep"):
        Versus("pp", 2)
    with pytest.raises(ValueError, match=r"CompareOptions.versus must be a Versus\(axis, b\)"):
        CompareOptions(versus=("dp", 1))


def test_an_expert_parallel_rank_holds_its_own_experts_under_their_local_numbers():
    pytest.importorskip("megatron.core")
    from harness.runners.megatron.model import name_map
    from harness.runners.megatron.train import expert_shard

    names = name_map({"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 8})
    mine = expert_shard(names, 8, 2, 1)["parameters"]
    experts = {c: m for c, (m, _) in mine.items() if ".mlp.experts." in c}
    assert sorted(experts) == sorted(c for c in names["parameters"] if any(f".experts.{e}." in c for e in (4, 5, 6, 7)))
    assert experts["model.layers.1.mlp.experts.6.down_proj.weight"] == \
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    assert len(mine) == len(names["parameters"]) - 8 and expert_shard(names, 8, 1, 0) is names
