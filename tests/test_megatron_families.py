"""Every model family on Megatron-Core (harness/runners/megatron/families.py): one test per question, parametrized
over the family registry. The contract: each family's tiny GPTModel, built by the room's one builder, has every
parameter named by the family's names.toml [megatron] section and every canonical parameter and buffer mapped; then
the settings each family takes from Megatron Bridge (or departs from it in, named in the knobs)."""

from __future__ import annotations

import json

import pytest

from harness.families import FAMILIES, model_config
from tests.support.installed import absent, megatron_has_dsa_switches
from tests.support.tiny_models import TINY
from tests.support.zoo import python_json

# The families Megatron-Core builds here: all but those whose attention has a DSA indexer (GLM-5) or with Gated DeltaNet
# layers (Qwen3.5-MoE), which the room refuses naming what is missing
# (test_a_family_with_a_dsa_indexer_is_unsupported_naming_what_is_missing, tests/test_qwen3_5_moe.py)
BUILT = [name for name in FAMILIES if FAMILIES[name].architecture(model_config(TINY[name])).attention.indexer is None
         and FAMILIES[name].architecture(model_config(TINY[name])).linear_attention is None]

BUILD = """
    import json, sys, torch
    from harness.families import model_config
    from harness.runners.megatron import families, model as mm
    mm.init_process_group(torch.device("cpu"))
    out = {}
    for name, wire in json.loads(sys.argv[1]).items():
        m = model_config(wire)
        adapters = mm.install_adapters(torch.device("cpu"), m)
        config, _ = mm.translate_config(m, torch.float32, torch.device("cpu"))
        model = mm.build_model(config, m, torch.device("cpu"))
        names = mm.name_map(m)
        checkpoint = {n: torch.zeros(shape, dtype=torch.float32) for n, shape, _ in m.record.parameters(m)}
        mm.load_weights(model, names, checkpoint)
        out[name] = {
            "parameters": sorted(n for n, _ in model.named_parameters()),
            "buffers": sorted(n for n, _ in model.named_buffers()),
            "mapped": {kind: {c: target for c, (target, _) in names[kind].items()}
                       for kind in ("parameters", "buffers")},
            "adapters": [a["name"] for a in adapters], "implementation": families.implementation(m)}
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def built():
    """Each family's tiny model built, mapped and loaded in one fresh interpreter (Megatron-Core's process group and
    CPU shims are process-wide)."""
    return python_json(BUILD, json.dumps({name: TINY[name] for name in BUILT}))


def unmapped(megatron_parameters: list[str], mapped: dict[str, str]) -> list[str]:
    """The Megatron parameters no name-map entry names."""
    return sorted(set(megatron_parameters) - set(mapped.values()))


def test_every_family_has_a_tiny_config():
    assert set(TINY) == set(FAMILIES)


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="builds Megatron-Core models")
@pytest.mark.parametrize("family", BUILT)
def test_every_megatron_parameter_and_every_canonical_tensor_is_mapped(built, family):
    """The contract over the registry: every parameter of the built GPTModel is named by the family's [megatron]
    section, every canonical parameter (gradient) and buffer of the family's layout has its entry, each buffer is one
    of Megatron's, and the checkpoint loaded (load_weights checks each shape and dtype)."""
    got, m = built[family], model_config(TINY[family])
    assert unmapped(got["parameters"], got["mapped"]["parameters"]) == []
    assert set(got["mapped"]["parameters"]) == {n.removeprefix("grad.") for n, _ in m.record.gradients(m)}
    assert set(got["mapped"]["buffers"]) == {n for n, _ in m.record.buffers(m)}
    assert set(got["mapped"]["buffers"].values()) <= set(got["buffers"])


def test_the_contract_check_sees_an_unmapped_parameter():
    """Negative control: a Megatron parameter no entry names is reported."""
    assert unmapped(["a.weight", "b.weight"], {"x": "a.weight"}) == ["b.weight"]


ADAPTERS = {"deepseek_v3": ["MLADotProductAttention"], "glm4_moe": [], "minimax_m2": ["FullDimQKNorm"],
            "qwen2_moe": ["routing_record"], "qwen3_moe": ["routing_record"]}


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="builds Megatron-Core models")
@pytest.mark.parametrize("family", BUILT)
def test_each_family_gets_the_modules_its_architecture_needs(built, family):
    """The adapters meta.json names (the CPU shims after the family's own) and the implementation text."""
    own = built[family]["adapters"][:len(ADAPTERS[family])]
    assert own == ADAPTERS[family]
    assert built[family]["implementation"] == model_config(TINY[family]).record.stack("megatron")["implementation"]


# --- the settings each family takes (Megatron Bridge's providers, or the harness's departures) ------------------

# family -> (overrides of its tiny config, dtype, expected TransformerConfig fields, (knob, text in it),
# GPTModel's own arguments)
SETTINGS = {
    "deepseek_v3": ({}, "float32", dict(
        q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True,
        rope_type="yarn", rotary_scaling_factor=32.0, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_pre_softmax=False, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none"),
        ("moe_router_dtype", "Kimi-K2"), {}),
    "glm4_moe": ({"use_qk_norm": True, "routed_scaling_factor": 2.5}, "float32", dict(
        num_query_groups=2, kv_channels=32, add_qkv_bias=True, add_bias_linear=False, qk_layernorm=True,
        moe_layer_freq=[0, 1], moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
        moe_router_bias_update_rate=0.0, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=32, softmax_scale=32 ** -0.5),
        ("moe_router_score_function", "Bridge"), {"rotary_percent": 0.5, "rotary_base": 1e6}),
    "minimax_m2": ({}, "bfloat16", dict(
        num_query_groups=2, kv_channels=32, add_qkv_bias=False, add_bias_linear=False, qk_layernorm=True,
        moe_ffn_hidden_size=32, moe_layer_freq=[1, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None,
        moe_router_dtype=None, moe_router_bias_update_rate=0.0, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", moe_shared_expert_intermediate_size=None, softmax_scale=32 ** -0.5),
        ("qk_layernorm", "Bridge"), {"rotary_percent": 0.5, "rotary_base": 5e6}),
    "qwen2_moe": ({}, "bfloat16", dict(
        num_query_groups=2, kv_channels=8, add_qkv_bias=True, add_bias_linear=False, qk_layernorm=False,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True, moe_shared_expert_overlap=False, moe_layer_freq=[1, 1],
        moe_router_score_function="softmax", moe_router_pre_softmax=True, moe_router_dtype=None,
        moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", softmax_scale=8 ** -0.5),
        ("moe_router_pre_softmax", "not norm_topk_prob"), {"rotary_percent": 1.0, "rotary_base": 1e6}),
    "qwen3_moe": ({}, "bfloat16", dict(
        num_query_groups=2, kv_channels=16, add_qkv_bias=False, add_bias_linear=False, qk_layernorm=True,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 1],
        moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_dtype=None,
        moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None,
        moe_shared_expert_intermediate_size=None, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        softmax_scale=16 ** -0.5),
        ("moe_router_pre_softmax", "Bridge"), {"rotary_percent": 1.0, "rotary_base": 1e6}),
}


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron builder imports megatron.core")
@pytest.mark.parametrize("family", BUILT)
def test_the_builder_takes_each_familys_settings(family):
    import torch

    from harness.runners.megatron import families

    overrides, dtype, expected, (knob, text), rope = SETTINGS[family]
    m = model_config({**TINY[family], **overrides})
    config, knobs = families.translate_config(m, getattr(torch, dtype), torch.device("cpu"))
    assert {field: getattr(config, field) for field in expected} == expected
    assert text in knobs[knob]
    assert families.gpt_model_kwargs(m) == rope


# family -> (overrides that make its layers dense or its router otherwise, expected fields)
VARIANTS = {
    "qwen2_moe": ({"norm_topk_prob": True, "mlp_only_layers": [0]},
                  {"moe_router_pre_softmax": False, "moe_layer_freq": [0, 1]}),
    "qwen3_moe": ({"norm_topk_prob": False, "mlp_only_layers": [0]},  # Bridge: pre_softmax = not norm_topk_prob
                  {"moe_router_pre_softmax": True, "moe_layer_freq": [0, 1]}),
}


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron builder imports megatron.core")
@pytest.mark.parametrize("family", list(VARIANTS))
def test_the_router_order_follows_norm_topk_prob_and_dense_layers_follow_hfs_rule(family):
    import torch

    from harness.runners.megatron import families

    overrides, expected = VARIANTS[family]
    config, _ = families.translate_config(model_config({**TINY[family], **overrides}), torch.float32,
                                          torch.device("cpu"))
    assert {field: getattr(config, field) for field in expected} == expected


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron builder imports megatron.core")
@pytest.mark.parametrize("family, router_dtype", [("deepseek_v3", "fp64"), ("glm4_moe", "fp64"),
                                                  ("minimax_m2", "fp64"), ("qwen2_moe", None), ("qwen3_moe", None)])
def test_a_float64_case_keeps_the_router_gemm_in_float64_where_the_family_sets_a_router_dtype(family, router_dtype):
    import torch

    from harness.runners.megatron import families

    config, _ = families.translate_config(model_config(TINY[family]), torch.float64, torch.device("cpu"))
    assert config.moe_router_dtype == router_dtype


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron builder imports megatron.core")
@pytest.mark.parametrize("family", [name for name in BUILT if FAMILIES[name].architecture(
    model_config(TINY[name])).moe.scoring == "sigmoid"])
def test_a_sigmoid_router_with_one_expert_per_token_is_unsupported(family):
    """Megatron's sigmoid router leaves a single top-1 score unnormalised (moe_utils.topk_routing_with_score_function:
    probs = scores when topk == 1) where HF divides it by itself: UNSUPPORTED, not a DIFF of the mapping's making.
    Found for DeepSeek-V3 and GLM-4.5 when the room wrote the check once (only MiniMax-M2 had it)."""
    import torch

    from harness.run.protocol import Unsupported
    from harness.runners.megatron import families

    m = model_config({**TINY[family], "num_experts_per_tok": 1})
    with pytest.raises(Unsupported, match="single top-1 score unnormalised"):
        families.translate_config(m, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(absent("torch", "megatron.core") or megatron_has_dsa_switches(),
                    reason="megatron-core 0.16-0.18 (0.19 builds GLM-5: tests/test_megatron_dsa.py)")
@pytest.mark.parametrize("family", [name for name in FAMILIES
                                    if FAMILIES[name].architecture(model_config(TINY[name])).attention.kind == "mla"
                                    and FAMILIES[name].architecture(model_config(TINY[name])).attention.indexer])
def test_a_family_with_a_dsa_indexer_is_unsupported_naming_what_is_missing(family):
    """megatron-core 0.16's indexer always applies its Hadamard rotation (fast_hadamard_transform, bf16): the room
    refuses before it builds anything, naming the version that can switch it off (0.19: tests/test_megatron_dsa.py)."""
    import torch

    from harness.run.protocol import Unsupported
    from harness.runners.megatron import families

    with pytest.raises(Unsupported, match="indexer needs megatron-core >= 0.19"):
        families.translate_config(model_config(TINY[family]), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron builder imports megatron.core")
def test_a_family_no_released_megatron_core_builds_is_unsupported_naming_its_blocks():
    """DeepSeek-V4's megatron.toml says what no released Megatron-Core has (its compressed attentions, hyper-
    connections, hash routing): the room refuses with that text and the installed version before it builds."""
    import torch

    from harness.run.protocol import Unsupported
    from harness.runners.megatron import families

    with pytest.raises(Unsupported, match=r"DeepSeek-V4's blocks are in no released Megatron-Core \(installed: "
                                          r"\d+\.\d+\.\d+\): no compressed sparse attention .* no hash routing"):
        families.translate_config(model_config(TINY["deepseek_v4"]), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron builder imports megatron.core")
def test_the_all_heads_norm_is_named_and_can_be_left_out():
    from harness.runners.megatron import families

    m = model_config(TINY["minimax_m2"])
    assert families.install_adapters(m) == ["FullDimQKNorm"] and families.install_adapters(m, {"FullDimQKNorm"}) == []
    assert families.ADAPTERS["FullDimQKNorm"].startswith(
        "a module the family needs that Megatron-Core's local spec lacks; Megatron Bridge provides it in its TE spec")
