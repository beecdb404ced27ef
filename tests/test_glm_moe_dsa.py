"""The GLM-5 family (harness/families/glm_moe_dsa) without the harness's runners, which do not build it yet: its typed
config (GLM-5's defaults, errors naming key and value), its layout (the DSA indexer's parameters and outputs, no
gradient for them), its [hf] name map checked against transformers' own GlmMoeDsaForCausalLM built at a tiny config,
and the fact the layout rests on: the LM loss gives the indexer no gradient in transformers. docs/model.md "GLM-5"."""

from __future__ import annotations

import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES
from harness.families.names import NameMap, expand_stack
from tests.support.installed import absent
from tests.support.tiny_models import TINY as TINY_MODELS
from tests.support.zoo import assert_config_refused

FAMILY = FAMILIES["glm_moe_dsa"]
GlmMoeDsaConfig = FAMILY.config
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
TINY = {k: v for k, v in TINY_MODELS["glm_moe_dsa"].items() if k != "family"}


def test_defaults_are_glm_5s_values():
    glm5 = GlmMoeDsaConfig.resolve({})
    a = FAMILY.architecture(glm5)
    assert (a.hidden, a.layers, a.vocab, a.dense_layers, len(a.moe_layers)) == (6144, 78, 154880, (0, 1, 2), 75)
    at = a.attention
    assert (at.kind, at.heads, at.head_dim, at.v_head_dim, at.rotary_dim, at.q_lora_rank, at.kv_lora_rank) == (
        "mla", 64, 192 + 64, 256, 64, 2048, 512)
    assert (at.indexer.heads, at.indexer.head_dim, at.indexer.topk, at.rope_theta) == (32, 128, 2048, 1e6)
    assert (a.moe.experts, a.moe.topk, a.moe.ffn, a.moe.shared_ffn, a.moe.topk_scaling) == (256, 8, 2048, 2048, 2.5)
    assert GlmMoeDsaConfig.from_dict(glm5.to_dict()) == glm5


@pytest.mark.parametrize("given, problem", [
    ({"num_hidden_layers": 2}, "mlp_layer_types must have one entry per layer"),
    ({"num_hidden_layers": 2, "mlp_layer_types": ["dense", 1]}, "mlp_layer_types must be a list of str"),
    ({"num_hidden_layers": 2, "mlp_layer_types": ["dense", "moe"]}, "entries must be 'dense' or 'sparse'"),
    ({"index_head_dim": 32}, "must hold the rotated qk_rope_head_dim"),
    ({"attention_bias": True}, "attention_bias must be one of"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "glm_moe_dsa", GlmMoeDsaConfig, given, problem)


def test_the_indexer_adds_its_parameters_and_outputs_but_no_gradient():
    m = GlmMoeDsaConfig.resolve(TINY)
    names = [name for name, _, _ in FAMILY.parameters(m)]
    for layer in (0, 1):
        p = f"model.layers.{layer}.self_attn."
        at = names.index(p + "kv_b_proj.weight")
        assert names[at + 1:at + 6] == [p + "indexer." + n for n in INDEXER]  # after MLA's, in HF's order
    grads = {name for name, _ in FAMILY.gradients(m)}
    assert not any(".indexer." in g for g in grads) and "grad.model.layers.0.self_attn.kv_b_proj.weight" in grads
    specs = {s.name: s for s in FAMILY.modules(m, 5)}
    selected = specs["module.model.layers.1.self_attn.indexer.selected"]
    assert (selected.shape, selected.dtype) == ((5, 5), "int64")
    assert specs["module.model.layers.0.self_attn.indexer.wq_b"].shape == (5, 2 * 16)
    assert specs["module.model.layers.0.self_attn.core_attention"].shape == (5, 2 * 12)  # heads x v_head_dim
    order = [name.removeprefix("module.model.layers.0.self_attn.") for name in specs]
    assert order.index("kv_b_proj") < order.index("indexer.wq_b") < order.index("indexer.selected") < order.index(
        "core_attention")


def test_the_2layer_cases_have_90_gradients_and_say_their_pairs():
    registry = Registry.load()
    case = registry.get("glm_moe_dsa_2layer")
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 90 == 1 + 11 + 12 + 32 * 2 + 2
    assert sum(s.name.endswith(".indexer.selected") for s in case.output_specs()) == 2
    cases = {name: c for name, c in registry.cases.items() if name.startswith("glm_moe_dsa_")}
    assert {name: (c.dtype, c.runners, c.expect.verdict) for name, c in cases.items()} == {
        "glm_moe_dsa_2layer": ("bfloat16", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_fp32": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_fp32_dense_index": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_float64": ("float64", ("hf_model", "hf_model"), "WITHIN_TOLERANCE"),
        "glm_moe_dsa_2layer_control_hf": ("float32", ("hf_model", "hf_model"), "DIFF"),
        "glm_moe_dsa_2layer_fp32_megatron": ("float32", ("megatron_model", "hf_model"), "UNSUPPORTED"),
        "glm_moe_dsa_2layer_fp32_megatron_eps": ("float32", ("megatron_model", "hf_model"), "UNSUPPORTED"),
        "glm_moe_dsa_2layer_megatron": ("float32", ("megatron_model", "hf_model"), "DIFF"),
        "glm_moe_dsa_2layer_megatron_eps": ("float32", ("megatron_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model"), "UNSUPPORTED"),
        "glm_moe_dsa_2layer_train": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_train_float64": ("float64", ("hf_model", "hf_model"), "WITHIN_TOLERANCE"),
        "glm_moe_dsa_2layer_train_control_hf": ("float32", ("hf_model", "hf_model"), "DIFF"),
        "glm_moe_dsa_2layer_train_megatron": ("float32", ("megatron_model", "hf_model"), "UNSUPPORTED"),
        "glm_moe_dsa_2layer_train_megatron_eps": ("float32", ("megatron_model", "hf_model"), "UNSUPPORTED"),
        "glm_moe_dsa_2layer_train_megatron_gpu": ("float32", ("megatron_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_full": ("bfloat16", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "glm_moe_dsa_2layer_full_megatron": ("bfloat16", ("megatron_model", "hf_model"), "BITWISE_PASS")}
    assert cases["glm_moe_dsa_2layer_fp32_dense_index"].model.index_topk >= case.tokens > case.model.index_topk


def _hf_model(m, device: str):
    import torch
    from transformers import GlmMoeDsaConfig as HfConfig
    from transformers import GlmMoeDsaForCausalLM

    keys = {k: v for k, v in m.to_dict().items() if k not in ("family", "rope_theta")}
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}  # transformers 5's form of the key
    config = HfConfig(**keys, rope_parameters=rope, attn_implementation="eager", experts_implementation="eager")
    assert config.rope_parameters == rope and config.mlp_layer_types == list(m.mlp_layer_types)
    with torch.device(device):
        return GlmMoeDsaForCausalLM(config)


@pytest.mark.skipif(absent("transformers"), reason="transformers is not installed")
def test_hf_names_and_shapes_are_the_layouts_through_the_name_map():
    """transformers 5.3.0's model, built on the meta device: each parameter and buffer is made by [hf.checkpoint] from
    canonical tensors of the layout's shapes, and every canonical tensor is used once."""
    m = GlmMoeDsaConfig.resolve(TINY)
    canonical = {name: shape for name, shape, _ in FAMILY.parameters(m)}
    name_map = NameMap.load("glm_moe_dsa", "hf", model=m)
    used = []
    for name, tensor in _hf_model(m, "meta").state_dict().items():
        rule = name_map.rule("checkpoint", name, m)
        if rule.kind == "same":
            used.append(rule.sources[0])
            assert tuple(tensor.shape) == canonical[rule.sources[0]], name
            continue
        assert rule.kind in ("stack", "stack_cat0"), (name, rule.kind)
        per_expert = expand_stack(rule)
        used += [n for names in per_expert for n in names]
        rows = sum(canonical[n][0] for n in per_expert[0])
        assert tuple(tensor.shape) == (len(per_expert), rows, canonical[per_expert[0][0]][1]), name
    assert sorted(used) == sorted(canonical)


@pytest.mark.skipif(absent("transformers"), reason="transformers is not installed")
def test_hf_gives_the_indexer_no_gradient_and_every_other_parameter_one():
    """Why the layout has no gradient for the indexer: transformers runs it under no_grad (fp32, 8 tokens, top-3)."""
    import torch

    m = GlmMoeDsaConfig.resolve(TINY)
    torch.manual_seed(0)
    model = _hf_model(m, "cpu")
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    without = sorted(n for n, p in model.named_parameters() if p.grad is None)
    assert without == sorted(FAMILY.detached(m))


# For tests/test_model_e2e.py once a runner builds GLM-5: a planted float64 difference in the indexer's LayerNorm bias
# (a tensor only this family has) must be a mapping error naming module.model.layers.0.self_attn.indexer.k_norm.
PLANTED_FLOAT64 = ("glm_moe_dsa_2layer_float64", "model.layers.0.self_attn.indexer.k_norm.bias", (3,))
