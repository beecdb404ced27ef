"""The PaddleFleet level's paths (harness.runners.paddle.fleet) against a stand-in ``paddlefleet`` package written from
the cited source (tests/support/paddlefleet_stand_in, a test double): every path runs with the constructor and forward
signatures the source has, calls exactly the PaddleFleet names ``fleet.PATHS`` claims, passes the case's gate, and
says in its implementation and ``paddle_source`` that it was checked against the stand-in only. The stand-in's
arithmetic is not PaddleFleet's: nothing here is compared for bits."""

import sys
from pathlib import Path

import numpy as np
import pytest

from harness.case import ops

paddle = pytest.importorskip("paddle")

STAND_IN = Path(__file__).parent / "support" / "paddlefleet_stand_in"
SETUP = ("paddlefleet.transformer.transformer_config.TransformerConfig",)  # built by every path, not a claim

SHAPES = {
    "column_parallel_linear": {"input_size": 8, "output_size": 6},
    "row_parallel_linear": {"input_size": 8, "output_size": 6},
    "rms_norm": {"hidden_size": 8},
    "swiglu": {"ffn_hidden_size": 4},
    "embedding": {"vocab_size": 10, "hidden_size": 8},
    "moe_router": {"hidden_size": 8, "num_experts": 6, "topk": 2},
    "attention_scores": {"num_heads": 2, "head_dim": 4},
    "shared_expert_mlp": {"hidden_size": 8, "ffn_hidden_size": 4},
    "routed_experts": {"hidden_size": 8, "ffn_hidden_size": 4, "num_local_experts": 2},
    "mla_up_projection": {"lora_rank": 8, "num_heads": 2, "head_dim": 3},
}
VARIANTS = {"swiglu": ({}, {"per_token_scale": True})}  # knobs that take another PaddleFleet path


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in package on sys.path for one test; its modules and the level's import cache gone afterwards."""
    monkeypatch.syspath_prepend(str(STAND_IN))
    from harness.runners.paddle import fleet

    fleet._import_problem.cache_clear()
    yield fleet
    for name in [n for n in sys.modules if n == "paddlefleet" or n.startswith("paddlefleet.")]:
        del sys.modules[name]
    fleet._import_problem.cache_clear()


def _request(op_name, config):
    op = ops.OPS[op_name]
    return {"op": op_name, "device": "cpu", "dtype": "float32", "tokens": 4, "tp": 1, "shapes": SHAPES[op_name],
            "config": op.resolve(config)}


def _tensors(request):
    rng = np.random.default_rng(3)
    specs = ops.OPS[request["op"]].inputs(request["shapes"], request["tokens"], request["config"])
    return {s.name: (rng.integers(0, s.high or 2, s.shape) if s.dtype and s.dtype.startswith("int")
                     else rng.uniform(0.1, 1.0, s.shape).astype(np.float32)) for s in specs}


def _run(fleet, op_name, config, gate):
    import paddlefleet

    paddlefleet.CALLS.clear()
    request = _request(op_name, {**config, "use_accuracy_compatible": gate})
    outputs, implementation = fleet.IMPLEMENTATIONS[ops.OPS[op_name]](
        request, _tensors(request), gate, lambda name: _Phase(), lambda call, kernel, request: call())
    return request, outputs, implementation, list(paddlefleet.CALLS)


class _Phase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_every_op_the_level_runs_has_a_path_record():
    from harness.runners.paddle import fleet

    assert set(fleet.PATHS) == set(fleet.IMPLEMENTATIONS)
    assert {path.kind for path in fleet.PATHS.values()} <= set(fleet.KINDS)
    for path in fleet.PATHS.values():
        assert path.calls and all(name.startswith("paddlefleet.") for name in path.calls)
        assert all("@" in piece for piece in path.pieces[:1]), path  # the first piece names its file@commit


@pytest.mark.parametrize("op_name", sorted(SHAPES))
@pytest.mark.parametrize("gate", [True, False], ids=["gate_on", "gate_off"])
def test_each_path_calls_what_it_claims_with_what_the_source_requires(stand_in, op_name, gate):
    fleet = stand_in
    path = fleet.PATHS[ops.OPS[op_name]]
    called = set()
    for config in VARIANTS.get(op_name, ({},)):
        request, outputs, implementation, calls = _run(fleet, op_name, config, gate)
        names = {name for name, _ in calls} - set(SETUP)
        assert names <= set(path.calls), f"{op_name} calls {sorted(names - set(path.calls))}, not claimed"
        called |= names
        expected = {s.name for s in ops.OPS[op_name].outputs(request["shapes"], request["tokens"], request["config"])}
        assert set(outputs) == expected, op_name
        assert fleet.STAND_IN_ONLY in implementation and fleet.KINDS[path.kind] in implementation
        assert fleet.STAND_IN_ONLY in fleet.source(request)
        for name, arguments in calls:  # the case's gate reaches PaddleFleet: in the config, or as the argument
            if "config" in arguments:
                assert arguments["config"].use_accuracy_compatible is gate, name
            if "use_accuracy_compatible" in arguments:
                assert arguments["use_accuracy_compatible"] is gate, name
    assert called == set(path.calls), f"{op_name} claims {sorted(set(path.calls) - called)} but never calls them"


def test_the_swiglu_with_a_scale_passes_the_scale_as_mlp_forward_does(stand_in):
    """MLP.forward (mlp.py@9f9bd7b9) hands weighted_bias_swiglu_impl per_token_scale.unsqueeze(-1), no bias."""
    _, _, _, calls = _run(stand_in, "swiglu", {"per_token_scale": True}, True)
    (name, arguments), = calls
    assert name.endswith("weighted_bias_swiglu_impl")
    assert arguments["weights_shape"] == [4, 1] and arguments["bias"] is None and arguments["clamp_value"] is None


def test_the_level_stays_unavailable_on_a_cpu_even_where_paddlefleet_imports(stand_in):
    reason = stand_in.unavailable({"device": "cpu"})
    assert "PaddleFleet runs on a GPU only" in reason and "not importable" not in reason
