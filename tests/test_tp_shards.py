"""Tensor-parallel bookkeeping without any framework: shard indices, rank file names, gathering, case knobs.

The round trip (split every tensor by the op's partition dims, gather it back) must give the canonical tensor
for every op and knob; a replicated tensor that differs between ranks must be reported.
"""

import numpy as np
import pytest
from safetensors.numpy import save_file

from harness.case.checkpoints import load_tensors
from harness.case.ops import OPS
from harness.case.registry import CaseError, Registry
from harness.run.protocol import rank_file_name, shard_index
from harness.run.shards import GatherError, gather, inconsistent
from tests.support.cases import registry_from


@pytest.mark.parametrize("op", sorted(name for name, spec in OPS.items() if spec.partition({})))  # ops with TP
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_split_then_gather_gives_back_every_output(tmp_path, op, sequence_parallel, tp):
    config = {"bias": True, "sequence_parallel": sequence_parallel}
    spec = OPS[op]
    outputs = spec.outputs({field: 16 for field in spec.shape_fields}, 8, config)  # 16 and 8: divisible by tp
    partition = spec.partition(config)
    rng = np.random.default_rng(0)
    full = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in outputs}
    for rank in range(tp):
        shard = {n: np.ascontiguousarray(a[shard_index(a.shape, partition[n], rank, tp)]) for n, a in full.items()}
        save_file(shard, str(tmp_path / rank_file_name("outputs.safetensors", rank, tp)))
    checks = gather(tmp_path, tp, list(full), partition)
    gathered = load_tensors(tmp_path / "outputs.safetensors")
    for name, array in full.items():
        assert np.array_equal(gathered[name].view(np.uint32), array.view(np.uint32)), name
    assert not inconsistent(checks)
    assert {n for n, c in checks.items() if c.get("replicated")} == {n for n in full if partition[n] is None}


def test_column_parallel_partition_is_the_megatron_one():
    column, row = OPS["column_parallel_linear"].partition({}), OPS["row_parallel_linear"].partition({})
    assert (column["out"], column["grad.weight"], column["grad.input"]) == (1, 0, None)
    assert (row["out"], row["grad.weight"], row["grad.input"]) == (None, 1, 1)
    assert OPS["row_parallel_linear"].partition({"sequence_parallel": True})["out"] == 0


def test_a_replicated_tensor_that_differs_between_ranks_is_reported(tmp_path):
    grad = np.ones((4, 3), np.float32)
    other = grad.copy()
    other[1, 2] = np.nextafter(np.float32(1), np.float32(2))
    for rank, g in enumerate((grad, other)):
        save_file({"grad.input": g}, str(tmp_path / f"outputs.rank{rank}.safetensors"))
    checks = gather(tmp_path, 2, ["grad.input"], {"grad.input": None})
    assert inconsistent(checks) == ["grad.input"]
    assert checks["grad.input"]["mismatches_vs_rank0"] == {"1": 1}


def test_a_missing_rank_file_or_tensor_is_a_gather_error(tmp_path):
    save_file({"out": np.zeros((2, 2), np.float32)}, str(tmp_path / "outputs.rank0.safetensors"))
    with pytest.raises(GatherError, match="outputs.rank1.safetensors"):
        gather(tmp_path, 2, ["out"], {"out": 1})
    save_file({"other": np.zeros((2, 2), np.float32)}, str(tmp_path / "outputs.rank1.safetensors"))
    with pytest.raises(GatherError, match="lacks tensor 'out'"):
        gather(tmp_path, 2, ["out"], {"out": 1})


def test_rank_file_names_and_shard_indices():
    assert rank_file_name("outputs.safetensors", 0, 1) == "outputs.safetensors"
    assert rank_file_name("meta.json", 3, 4) == "meta.rank3.json"
    assert shard_index((8, 6), 1, 2, 3) == (slice(None), slice(4, 6))
    assert shard_index((8, 6), None, 2, 3) == (slice(None), slice(None))


CASE = """
[fc1]
family = "linear"
op = "column_parallel_linear"
dtype = "float32"
seed = 1
tokens = 6
tp = 2
shapes = { input_size = 8, output_size = 4 }
"""


@pytest.mark.parametrize("edit, message", [
    ("config = { sequence_parallel = true }\ntp = 1", "'config.sequence_parallel': needs tp > 1"),
    ("config = { sequence_parallel = true }\ntp = 4", "'tokens': must be divisible by tp=4"),
    ("config = { sequence_parallel = 1 }", "'config.sequence_parallel': must be bool"),
])
def test_sequence_parallel_is_validated(tmp_path, edit, message):
    text = CASE.replace("tp = 2\n", "") + edit + "\n"
    if "tp = 4" in edit:
        text = text.replace("output_size = 4", "output_size = 8")
    with pytest.raises(CaseError, match=message):
        registry_from(tmp_path, text)


def test_tp_and_tokens_overrides_are_checked(tmp_path):
    text = CASE.replace("tp = 2", "tp = 2\nconfig = { sequence_parallel = true }").replace("tokens = 6", "tokens = 8")
    case = registry_from(tmp_path, text).get("fc1")
    assert case.with_tp(4).tp == 4
    with pytest.raises(CaseError, match=r"field 'shapes.output_size': must be divisible by tp=8 \(got 4\)"):
        case.with_tp(8)  # does not divide output_size=4
    with pytest.raises(CaseError, match="divisible by tp=2"):
        case.with_tokens(7)


def test_the_shipped_tp_cases_declare_tp_2():
    registry = Registry.load()
    assert {registry.get(n).tp for n in ("kimi_shared_fc1_tp2", "kimi_shared_fc2_tp2", "kimi_shared_fc1_tp2_sp")} == {2}
    assert registry.get("kimi_shared_fc2_tp2_sp").config["sequence_parallel"] is True
