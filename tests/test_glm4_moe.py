"""The GLM-4.5 MoE family (harness/families/glm4_moe) without running a whole model: its typed config (GLM-4.5-Air's
defaults, errors naming key and value), its layout (282 gradients for the 2-layer case), its name maps (q, k and v
interleaved per query group in Megatron's linear_qkv and Paddle's qkv_proj), Megatron Bridge's settings in the
Megatron builder, and the paddlefleet stand-in PaddleFormers' model module needs to import on a CPU: names only, none
called by a whole run. The model runs themselves: tests/test_model_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES, ModelConfigError, family_of
from harness.families.names import NameMap
from tests.support.installed import absent
from tests.support.zoo import assert_config_refused

Glm4MoeConfig = FAMILIES["glm4_moe"].config

ROOT = Path(__file__).resolve().parents[1]
TINY = {"family": "glm4_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128}


@pytest.fixture(scope="module")
def case():
    return Registry.load().get("glm4_moe_2layer")


# --- the typed config ------------------------------------------------------------------------------------------

def test_defaults_are_glm_4_5_airs_real_values():
    """zai-org/GLM-4.5-Air's config (Megatron Bridge GLM45AirModelProvider106B @ 89f594a7), not HF's class defaults
    (attention_bias False, rope_theta 10000, no head_dim)."""
    air = Glm4MoeConfig.resolve({})
    assert air.to_dict() == {
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "use_qk_norm": False,
        "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu", "family": "glm4_moe"}
    assert FAMILIES["glm4_moe"].architecture(air).attention.rotary_dim == 64
    assert Glm4MoeConfig.from_dict(air.to_dict()) == air


@pytest.mark.parametrize("given, problem", [
    ({"hidden_sizee": 4}, "unknown key 'hidden_sizee'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "must be a multiple of num_key_value_heads"),
    ({"head_dim": 20, "partial_rotary_factor": 0.25}, "head_dim x it an even integer"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in"),
    ({"norm_topk_prob": False}, "norm_topk_prob must be one of"),
    ({"n_group": 2}, "n_group must be one of"),
    ({"use_qk_norm": 1}, "use_qk_norm must be bool"),
    ({"head_dim": 0}, "head_dim must be > 0"),
    ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok must be <= n_routed_experts"),
    ({"first_k_dense_replace": 3, "num_hidden_layers": 2}, "first_k_dense_replace must be in"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "glm4_moe", Glm4MoeConfig, given, problem)


# --- the layout ------------------------------------------------------------------------------------------------

def test_the_2layer_case_has_282_gradients_with_q_k_v_apart(case):
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 282 == 1 + 11 + 12 + 128 * 2 + 2
    for layer in (0, 1):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert f"grad.model.layers.{layer}.self_attn.{name}.weight" in grads
            assert f"grad.model.layers.{layer}.self_attn.{name}.bias" in grads  # attention_bias
        assert f"grad.model.layers.{layer}.self_attn.q_norm.weight" not in grads  # GLM-4.5-Air: no qk-norm
    assert "grad.model.layers.1.mlp.gate.e_score_correction_bias" not in grads  # a buffer
    modules = {s.name: s for s in case.output_specs() if s.name.startswith("module.")}
    assert modules["module.model.layers.0.self_attn.q_proj"].shape == (64, 24 * 32)
    assert modules["module.model.layers.0.self_attn.k_proj"].shape == (64, 2 * 32)
    assert modules["module.model.layers.0.self_attn.core_attention"].shape == (64, 768)  # heads x head_dim
    family = family_of("glm4_moe")
    assert FAMILIES["glm4_moe"] is family and family.interleave(case.model) == (2, (12 * 32, 32, 32))
    assert family.buffers(case.model) == [("model.layers.1.mlp.gate.e_score_correction_bias", (128,))]


def test_qk_norm_and_dense_variants_add_and_drop_what_they_should():
    registry = Registry.load()
    qk = registry.get("glm4_moe_2layer_float64_qk_norm")
    grads = {s.name for s in qk.output_specs() if s.name.startswith("grad.")}
    assert len(grads) == 286 and "grad.model.layers.1.self_attn.k_norm.weight" in grads
    shapes = {s.name: s.shape for s in qk.output_specs()}
    assert shapes["module.model.layers.0.self_attn.q_norm"] == (64, 24, 32)  # per head
    assert shapes["module.model.layers.0.self_attn.k_norm"] == (64, 2, 32)
    assert qk.model.routed_scaling_factor == 2.5
    dense = registry.get("glm4_moe_2layer_float64_dense")
    assert not any(".mlp.experts." in s.name or ".mlp.gate." in s.name for s in dense.output_specs())
    unbiased = Glm4MoeConfig.resolve({**TINY, "attention_bias": False})
    assert not any(n.endswith(".bias") for n, _ in family_of("glm4_moe").gradients(unbiased))


def test_every_case_says_its_pair_and_the_variants_their_dtypes():
    registry = Registry.load()
    cases = {name: registry.get(name) for name in registry.cases if name.startswith("glm4_moe")}
    assert {n: (c.dtype, c.runners) for n, c in cases.items()} == {
        "glm4_moe_2layer": ("bfloat16", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_fp32": ("float32", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model")),
        "glm4_moe_2layer_float64": ("float64", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_float64_qk_norm": ("float64", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_float64_dense": ("float64", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "glm4_moe_2layer_full": ("bfloat16", ("megatron_model", "hf_model")),
        # the training level (cases/glm4_moe_train.toml)
        "glm4_moe_2layer_train": ("float32", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_train_bf16": ("bfloat16", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_train_sgd": ("float32", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_train_paddle": ("float32", ("megatron_model", "paddle_model")),
        "glm4_moe_2layer_train_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "glm4_moe_2layer_train_float64": ("float64", ("megatron_model", "hf_model")),
        "glm4_moe_2layer_train_float64_dense": ("float64", ("megatron_model", "paddle_model"))}
    full = cases["glm4_moe_2layer_full"].model
    assert (full.hidden_size, full.num_attention_heads, full.num_key_value_heads, full.head_dim,
            full.intermediate_size, full.moe_intermediate_size, full.n_routed_experts, full.vocab_size) == (
        4096, 96, 8, 128, 10944, 1408, 128, 151552) and cases["glm4_moe_2layer_full"].devices == ("gpu",)


# --- the name maps ---------------------------------------------------------------------------------------------

def test_paddle_fuses_q_k_v_per_group_and_gate_up_transposed(case):
    paddle = NameMap.load("glm4_moe", "paddle", model=case.model)
    rule = paddle.rule("checkpoint", "model.layers.1.self_attn.qkv_proj.weight")
    assert rule.kind == "transpose_interleave" and (rule.groups, rule.widths) == (2, (384, 32, 32))
    assert rule.sources == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    rule = paddle.rule("grads", "model.layers.0.self_attn.k_proj.bias")
    assert (rule.kind, rule.sources, rule.index) == ("deinterleave", ("model.layers.0.self_attn.qkv_proj.bias",), 1)
    assert paddle.rule("modules", "model.layers.0.self_attn.v_proj").kind == "deinterleave"
    assert paddle.rule("checkpoint", "model.layers.0.mlp.up_gate_proj.weight").kind == "cat0_transpose"
    assert paddle.rule("checkpoint", "model.layers.1.mlp.gate.weight").kind == "same"  # [E, H], not transposed
    assert paddle.float64_floor("grad.model.layers.0.self_attn.k_proj.bias", 1e-10) == 2e-6
    unbound = NameMap.load("glm4_moe", "paddle")
    with pytest.raises(ModelConfigError, match="needs the model's config"):
        unbound.rule("grads", "model.layers.0.self_attn.q_proj.weight")


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="Megatron's name map is read by its runner")
@pytest.mark.parametrize("qk_norm", [False, True])
def test_megatron_map_has_exactly_the_layouts_tensors(qk_norm):
    """linear_qkv's weight, bias and output are q, k and v interleaved: each is a part (deinterleave); q_layernorm
    exists only with use_qk_norm; every gradient of the layout, and nothing else, has an entry."""
    from harness.runners.megatron.model import name_map

    m = Glm4MoeConfig.resolve({**TINY, "use_qk_norm": qk_norm})
    names = name_map(m)
    assert set(names["parameters"]) == {n[len("grad."):] for n, _ in family_of("glm4_moe").gradients(m)}
    q = names["parameters"]["model.layers.1.self_attn.q_proj.weight"]
    assert q[0] == "decoder.layers.1.self_attention.linear_qkv.weight" and len(q[1]) == 3
    parts = names["parts"]
    assert {(parts[f"model.layers.0.self_attn.{p}_proj"].index, parts[f"model.layers.0.self_attn.{p}_proj"].sources)
            for p in "qkv"} == {(i, ("decoder.layers.0.self_attention.linear_qkv",)) for i in range(3)}
    assert parts["model.layers.0.self_attn.v_proj.bias"].widths == (64, 32, 32)
    assert ("model.layers.0.self_attn.q_norm" in names["modules"]) == qk_norm
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert names["buffers"] == {bias: ("decoder.layers.1.mlp.router.expert_bias", [bias])}


# --- the paddlefleet stand-in ----------------------------------------------------------------------------------

def python(code: str) -> dict:
    import os

    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The names PaddleFormers 1.2.0 imports from paddlefleet at module level (gpt_provider.py, model_provider.py;
# minimax_m2/modeling.py for transformer.utils), and the stand-in's own helpers (the package root)
IMPORT_TIME_NAMES = {
    "paddlefleet": ["CALLS", "Placeholder", "StandInUsed", "refuse"],
    "paddlefleet.gpt_builders": ["gpt_builder"], "paddlefleet.models": [],
    "paddlefleet.models.gpt": ["GPTModel"], "paddlefleet.models.gpt.gpt_config": ["GPTConfig"],
    "paddlefleet.models.gpt.gpt_layer_specs": ["get_gpt_layer_local_spec", "get_gpt_mtp_block_spec"],
    "paddlefleet.parallel_state": [], "paddlefleet.tensor_parallel": [], "paddlefleet.transformer": [],
    "paddlefleet.transformer.enums": ["ModelType"], "paddlefleet.transformer.layer": ["FleetLayer"],
    "paddlefleet.transformer.transformer_config": ["TransformerConfig"],
    "paddlefleet.transformer.utils": ["is_layer_window_attention"], "paddlefleet.utils": ["get_model_config"],
}


def test_the_stand_in_defines_import_time_names_only_and_each_refuses_a_call():
    result = python("""
        import json, sys
        from harness.runners.paddle import paddlefleet_shim as shim
        sys.path.insert(0, str(shim.FOLDER))
        import paddlefleet
        from paddlefleet.gpt_builders import gpt_builder
        from paddlefleet.models.gpt import GPTModel
        raised = []
        for call in (gpt_builder, GPTModel):
            try:
                call(1, x=2)
            except paddlefleet.StandInUsed as error:
                raised.append(str(error))
        print(json.dumps({"defined": shim.defined(), "calls": paddlefleet.CALLS, "raised": raised}))
    """)
    assert result["defined"] == IMPORT_TIME_NAMES
    assert result["calls"] == ["paddlefleet.gpt_builders.gpt_builder", "paddlefleet.models.gpt.GPTModel"]
    assert all("needs the real PaddleFleet" in r for r in result["raised"])


@pytest.mark.skipif(absent("paddle", "paddleformers"), reason="PaddleFormers' model (requirements-models.txt)")
def test_a_whole_run_calls_no_stand_in_name_and_leaves_no_paddlefleet_behind(tmp_path):
    """PaddleFormers' Glm4MoeForCausalLMDeprecated forward and backward (tiny, float32, 8 tokens): no stand-in name is
    called, no class of the model or of any sublayer comes from the stand-in, the runner names it in meta.json, and
    afterwards ``paddlefleet`` is neither importable nor in sys.modules (a worker's next cell sees no PaddleFleet)."""
    from tests.support.model_case import model_request

    request = model_request(tmp_path, {**TINY, "use_qk_norm": True}, "float32", tokens=8)
    result = python(f"""
        import importlib.util, json, sys
        from harness.runners.paddle import model as paddle_model, paddlefleet_ops_shim, paddlefleet_shim
        from harness.run.protocol import Phases
        paddlefleet_ops_shim.install()
        request = json.load(open({str(request)!r}))
        meta = paddle_model.run(request, Phases())
        model = paddle_model.build_model(request["config"]["model"], "float32", request["checkpoint"])[0]
        classes = {{c.__module__ for layer in [model, *model.sublayers()] for c in type(layer).__mro__}}
        import paddleformers.transformers.gpt_provider as provider
        print(json.dumps({{
            "calls": paddlefleet_shim.calls(), "adapters": meta["adapters"], "implementation": meta["implementation"],
            "from_stand_in": sorted(m for m in classes if m.split(".")[0] == "paddlefleet"),
            "findable": importlib.util.find_spec("paddlefleet") is not None,
            "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "paddlefleet"),
            "provider_bound_to_stand_in": provider.gpt_builder.__module__ == "paddlefleet",
        }}))
    """)
    assert result["calls"] == [] and result["from_stand_in"] == []
    assert not result["findable"] and result["loaded"] == []
    assert result["provider_bound_to_stand_in"]  # what the import bound is the stand-in's, and it was never called
    names = [a["name"] for a in result["adapters"]]
    assert "paddlefleet stand-in (harness.runners.paddle.paddlefleet_shim)" in names
    assert all(a["changes_computation"] is False for a in result["adapters"])
    assert "paddlefleet stand-in" in result["implementation"]
    assert next(a for a in result["adapters"] if a["name"].startswith("paddlefleet stand-in"))["calls"] == []


# --- what its end-to-end runs show (tests/test_model_e2e.py runs its cases: tests/support/zoo.py) ---------------

# Its float64 cases run by another pair than their own: PaddleFormers' MoE refuses float64, so with both layers dense
FLOAT64_PAIRS = [
    ("glm4_moe_2layer_float64", ("paddle_model", "hf_model"), "PaddleFormers' Glm4MoeMoE.moe cannot run in float64"),
    ("glm4_moe_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("glm4_moe_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
]
# One element of k_proj's bias planted on HF's side, in float64: Megatron's k_proj (a part of its fused linear_qkv)
# disagrees far beyond the floors there first, so the semantic check says ERROR naming it
PLANTED_FLOAT64 = ("glm4_moe_2layer_float64", "model.layers.0.self_attn.k_proj.bias", (3,))


def check_run(case, report, run_dir):
    """The cases' stated verdicts (bf16 Megatron vs HF part at the first RMSNorm, fp32 by layer 1's router on every
    CPU, at q_proj already on AMD EPYC, where HF's bias folded into the GEMM rounds apart from Megatron's added after;
    PaddleFormers vs HF at the first RMSNorm) have 282 gradients. The
    control, one bit of v_proj.bias[5] on Megatron's side b: Megatron holds it as a row of the fused linear_qkv, so
    only column 5 of the de-interleaved v_proj output differs, and the q_proj and k_proj parts of the same fused output
    stay equal: the interleave maps the planted element where it belongs."""
    if case.name in ("glm4_moe_2layer", "glm4_moe_2layer_fp32", "glm4_moe_2layer_fp32_paddle"):
        assert report["model"]["gradients"]["total"] == 282
    if case.name == "glm4_moe_2layer_control_megatron":
        import numpy as np

        from harness.case.checkpoints import load_tensors

        a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
        b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
        layer = "module.model.layers.0.self_attn."
        columns = {int(c) for c in np.nonzero((a[layer + "v_proj"] != b[layer + "v_proj"]).any(axis=0))[0]}
        assert columns == {5}
        assert np.array_equal(a[layer + "q_proj"], b[layer + "q_proj"]) and np.array_equal(a[layer + "k_proj"],
                                                                                             b[layer + "k_proj"])
