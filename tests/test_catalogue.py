"""The Kimi-K2 catalogue's own logic, without frameworks: op specs and block stages, integer and fp32 tensors,
first divergence, re-feed attribution, the gate-matrix table. Runs in well under a second."""


import numpy as np
import pytest

from harness.case.generate import generate
from harness.case.ops import OPS
from harness.case.registry import CaseError, Registry
from harness.compare.refeed import attribution
from harness.compare.result import first_divergence
from harness.compare.tensors import DIFF, EQUAL, TensorComparison, compare_tensor
from harness.report.gate_matrix_report import markdown as matrix_markdown
from tests.support.cases import tiny_case

SHAPES = {"hidden_size": 64, "ffn_hidden_size": 16}


def test_every_family_has_a_cpu_negative_control():
    registry = Registry.load()
    families = {case.family for case in registry.cases.values()}
    # a planted bit in an input (perturb), or in a training run's optimizer state after a step (train.flip)
    controlled = {case.family for case in registry.for_device("cpu")
                  if case.perturb or (case.train and case.train.flip)}
    assert families <= controlled, f"families without a negative control: {sorted(families - controlled)}"


def test_every_case_family_has_a_gpu_full_variant():
    registry = Registry.load()
    full = {case.family for case in registry.cases.values() if case.name.endswith("_full")}
    assert {case.family for case in registry.cases.values()} <= full


def test_block_stages_cover_every_block_output_once_with_the_stage_ops_own_names():
    spec = OPS["shared_expert_mlp"]
    block_inputs = {s.name: s.shape for s in spec.inputs(SHAPES, 8, {})}
    block_outputs = {s.name: s.shape for s in spec.outputs(SHAPES, 8, {})}
    made = []
    for stage in spec.stages(SHAPES, {"use_accuracy_compatible": True, "swiglu_impl": "eager"}):
        op = OPS[stage.op]
        stage_inputs = {s.name: s.shape for s in op.inputs(stage.shapes, 8, stage.config)}
        stage_outputs = {s.name: s.shape for s in op.outputs(stage.shapes, 8, stage.config)}
        assert set(stage.inputs) == set(stage_inputs) and set(stage.outputs) == set(stage_outputs), stage.name
        for name, source in stage.inputs.items():
            assert {**block_inputs, **block_outputs}[source] == stage_inputs[name], (stage.name, name)
        for name, target in stage.outputs.items():
            assert block_outputs[target] == stage_outputs[name], (stage.name, name)
        made += stage.outputs.values()
    assert sorted(made) == sorted(block_outputs)


def test_block_outputs_list_forward_before_backward():
    names = [s.name for s in OPS["shared_expert_mlp"].outputs(SHAPES, 8, {})]
    assert names.index("intermediate.fc1_out") < names.index("intermediate.act_out") < names.index("out")
    assert names.index("out") < names.index("intermediate.grad_act_out") < names.index("intermediate.grad_fc1_out")
    assert names.index("intermediate.grad_fc1_out") < names.index("grad.input")


def test_integer_ids_and_fp32_scales_are_generated_in_their_own_dtypes():
    registry = Registry.load()
    ids = generate(registry.get("kimi_embedding"))["ids"]
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 8
    assert len(np.unique(ids)) < ids.size  # repeated rows: the weight grad accumulates
    scale = generate(registry.get("kimi_swiglu_scaled"))["per_token_scale"]
    assert scale.dtype == np.float32 and scale.shape == (16,)


CASE = tiny_case("emb", family="embedding", op="embedding", dtype="bfloat16", seed=1, tokens=8,
                 shapes={"vocab_size": 32, "hidden_size": 8})


@pytest.mark.parametrize("extra, field", [
    ('tensors.ids = { dist = "randint", high = 33 }', "tensors.ids"),
    ('tensors.ids = { dist = "normal", std = 1.0 }', "tensors.ids"),
    ('tensors.weight = { dist = "randint", high = 3 }', "tensors.weight"),
    ('perturb = { side = "b", tensor = "ids", index = [1] }', "perturb.tensor"),
    ('config = { swiglu_impl = "compiled" }', "config.swiglu_impl"),
    ("config = { eps = 1 }", "config.eps"),
])
def test_bad_catalogue_fields_name_the_field(tmp_path, extra, field):
    (tmp_path / "bad.toml").write_text(CASE + extra + "\n")
    with pytest.raises(CaseError, match=f"bad.toml: case 'emb': field '{field}'"):
        Registry.load(tmp_path)


def test_integer_tensors_compare_by_value_without_ulps():
    a = np.array([[3, 1], [4, 1]], dtype=np.int64)
    b = np.array([[3, 1], [4, 5]], dtype=np.int64)
    result = compare_tensor("topk", a, b)
    assert (result.status, result.mismatches, result.first_mismatch["index"]) == (DIFF, 1, [1, 1])
    assert (result.first_mismatch["a"], result.first_mismatch["b"], result.max_ulp) == (1, 5, 0)
    assert compare_tensor("topk", a, a.copy()).status == EQUAL


def test_first_divergence_is_the_first_unequal_output_in_list_order():
    fake_tensors = [TensorComparison("intermediate.fc1_out", EQUAL), TensorComparison("out", DIFF),
                    TensorComparison("grad.input", DIFF)]
    assert first_divergence(fake_tensors) == "out"
    assert first_divergence(fake_tensors[:1]) is None


def test_refeed_attribution_tells_made_from_carried():
    assert attribution(TensorComparison("x", DIFF), TensorComparison("x", DIFF), "fc2").startswith("made by fc2")
    assert attribution(TensorComparison("x", DIFF), TensorComparison("x", EQUAL), "fc1").startswith("carried in")
    assert attribution(TensorComparison("x", EQUAL), TensorComparison("x", EQUAL), "fc1") == "equal"


def test_gate_matrix_table_has_one_row_per_setting_with_the_reason():
    fake_cells = [
        {"use_accuracy_compatible": True, "verdict": "DIFF", "message": "", "sides": "megatron vs paddle",
         "first_divergence": "out", "differing": ["out"], "implementations": ["m", "p"], "report": "r1"},
        {"use_accuracy_compatible": False, "verdict": "UNSUPPORTED", "sides": "megatron vs paddle",
         "message": "kernel `swiglu` is not registered", "first_divergence": None, "differing": [],
         "implementations": ["m", ""], "report": "r2"},
    ]
    rows = [line for line in matrix_markdown("kimi_swiglu", fake_cells).splitlines() if line.startswith("| o")]
    assert rows[0].startswith("| on |") and "**DIFF**" in rows[0] and "| out |" in rows[0]
    assert rows[1].startswith("| off |") and "**UNSUPPORTED**" in rows[1] and "swiglu" in rows[1]
