"""The Qwen3.5-MoE family (harness/families/qwen3_5_moe): its typed config (Qwen3.5-35B-A3B's defaults, errors naming
key and value), its layout (a Gated DeltaNet layer's parameters and outputs beside a gated-attention layer's, the
zero-centred norms), its cases (158 gradients, the pairs and what each states), the HF room's float64 islands for what
only this family has (the zero-centred RMSNorm, M-RoPE's three position rows), and the other stacks' refusals.
docs/model.md "Qwen3.5-MoE (qwen3_5_moe)". The whole compares are in tests/test_qwen3_5_moe_e2e.py (slow tier)."""

from __future__ import annotations

import importlib.util

import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES, model_config
from harness.run.protocol import Unsupported
from tests.support.installed import absent
from tests.support.tiny_models import TINY as TINY_MODELS
from tests.support.zoo import assert_config_refused

FAMILY = FAMILIES["qwen3_5_moe"]
Qwen35Config = FAMILY.config
TINY = {k: v for k, v in TINY_MODELS["qwen3_5_moe"].items() if k != "family"}
GDN = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight", "dt_bias",
       "A_log", "norm.weight", "out_proj.weight")


def test_defaults_are_qwen3_5_35b_a3bs_values():
    real = Qwen35Config.resolve({})
    a = FAMILY.architecture(real)
    assert (a.hidden, a.layers, a.vocab, a.dense_layers, a.zero_centred_norms) == (2048, 40, 248320, (), True)
    assert a.linear_layers == tuple(i for i in range(40) if i % 4 != 3)  # three GDN layers, then attention
    at, la = a.attention, a.linear_attention
    assert (at.heads, at.kv_heads, at.head_dim, at.rotary_dim, at.rope_theta, at.qk_norm, at.output_gate) == (
        16, 2, 256, 64, 1e7, "per_head", True)
    assert (la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (16, 32, 128, 128, 4)
    assert (a.moe.experts, a.moe.topk, a.moe.ffn, a.moe.shared_ffn, a.moe.norm_topk, a.moe.shared_gate) == (
        256, 8, 512, 512, True, True)
    assert Qwen35Config.from_dict(real.to_dict()) == real


@pytest.mark.parametrize("given, problem", [
    ({"num_hidden_layers": 2}, "layer_types must have one entry per layer"),
    ({"num_hidden_layers": 2, "layer_types": ["linear_attention", "attention"]}, "entries must be 'linear_attention'"),
    ({"linear_num_value_heads": 24}, "linear_num_value_heads .24. must be a multiple of linear_num_key_heads"),
    ({"head_dim": 20}, "must be an even number of dims"),
    ({"attention_bias": True}, "attention_bias must be one of"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "qwen3_5_moe", Qwen35Config, given, problem)


def test_a_gdn_layer_has_its_own_parameters_and_outputs_and_the_attention_a_gated_q_proj():
    m = Qwen35Config.resolve(TINY)
    params = {name: (shape, kind) for name, shape, kind in FAMILY.parameters(m)}
    names = list(params)
    gdn = [n.removeprefix("model.layers.0.linear_attn.") for n in names if n.startswith("model.layers.0.linear_attn.")]
    assert gdn == list(GDN) and not any(n.startswith("model.layers.0.self_attn.") for n in names)
    assert not any(n.startswith("model.layers.1.linear_attn.") for n in names)
    # in_proj_qkv: q and k of 2 heads x 16, v of 4 heads x 16; the conv over the same channels
    assert params["model.layers.0.linear_attn.in_proj_qkv.weight"][0] == (2 * 32 + 64, 64)
    assert params["model.layers.0.linear_attn.conv1d.weight"][0] == (2 * 32 + 64, 1, 4)
    assert params["model.layers.1.self_attn.q_proj.weight"][0] == (2 * 4 * 16, 64)  # queries and their gates
    # zero-centred gammas (near 0 in the checkpoint) everywhere but the GDN's gated norm (near 1)
    assert {n for n, (_, kind) in params.items() if kind == "zero_centred_norm"} == {
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight", "model.norm.weight"}
    assert params["model.layers.0.linear_attn.norm.weight"][1] == "norm"
    specs = {s.name: s.shape for s in FAMILY.modules(m, 5)}
    layer0 = [n.removeprefix("module.model.layers.0.") for n in specs if n.startswith("module.model.layers.0.")]
    assert layer0[:7] == ["input_layernorm", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                          "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.core_attention",
                          "linear_attn.out_proj"]
    assert specs["module.model.layers.0.linear_attn.core_attention"] == (5, 64)
    assert specs["module.model.layers.1.self_attn.q_proj"] == (5, 2 * 64)
    # Megatron's linear_qkv with attention_output_gate: per group 2 heads' queries and gates, then k, then v
    assert FAMILY.interleave(m) == (2, (2 * 2 * 16, 16, 16))


def test_the_2layer_cases_have_158_gradients_and_say_their_pairs():
    registry = Registry.load()
    case = registry.get("qwen3_5_moe_2layer")
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 158 == 1 + 11 + 8 + 2 * (1 + 32 * 2 + 2 + 1) + 2
    cases = {name: c for name, c in registry.cases.items()
             if name.startswith("qwen3_5_moe_2layer") and c.op == "causal_lm"}
    stated = {name: (c.dtype, c.runners, c.devices, c.expect.verdict if c.expect.stated else None)
              for name, c in cases.items()}
    assert stated == {
        "qwen3_5_moe_2layer": ("bfloat16", ("hf_model", "hf_model"), ("cpu",), "BITWISE_PASS"),
        "qwen3_5_moe_2layer_fp32": ("float32", ("hf_model", "hf_model"), ("cpu",), "BITWISE_PASS"),
        "qwen3_5_moe_2layer_float64": ("float64", ("hf_model", "hf_model"), ("cpu",), "WITHIN_TOLERANCE"),
        "qwen3_5_moe_2layer_control_hf": ("float32", ("hf_model", "hf_model"), ("cpu",), "DIFF"),
        "qwen3_5_moe_2layer_fp32_megatron": ("float32", ("megatron_model", "hf_model"), ("cpu",), "UNSUPPORTED"),
        "qwen3_5_moe_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model"), ("cpu",), "UNSUPPORTED"),
        # GPU twins, not yet run there: HF against itself (fla's kernels), Megatron on the local GDN spec against HF
        # (nothing stated), and Megatron's negative control (a DIFF by construction)
        "qwen3_5_moe_2layer_full": ("bfloat16", ("hf_model", "hf_model"), ("gpu",), None),
        "qwen3_5_moe_2layer_full_megatron": ("bfloat16", ("megatron_model", "hf_model"), ("gpu",), None),
        "qwen3_5_moe_2layer_megatron": ("float32", ("megatron_model", "hf_model"), ("gpu",), None),
        "qwen3_5_moe_2layer_megatron_control": ("float32", ("megatron_model", "megatron_model"), ("gpu",), "DIFF")}
    full = registry.get("qwen3_5_moe_2layer_full")
    assert (full.tokens, len([s for s in full.output_specs() if s.name.startswith("grad.")])) == (
        512, 1 + 11 + 8 + 2 * (1 + 256 * 2 + 2 + 1) + 2)


def test_the_control_states_the_flipped_gate_and_the_inputs_it_cannot_reach():
    """The planted bit is in in_proj_z (the GDN's output gate): its own output and everything after differ; the
    modules that read the layer's input beside it, and everything before, stay equal. The loss is not stated (it
    stayed equal at this shape: a float32 mean over 16 tokens)."""
    control = Registry.load().get("qwen3_5_moe_2layer_control_hf")
    assert control.perturb.tensor == "model.layers.0.linear_attn.in_proj_z.weight"
    assert control.expect.differs[0] == "module.model.layers.0.linear_attn.in_proj_z"
    siblings = {f"module.model.layers.0.linear_attn.in_proj_{p}" for p in ("qkv", "b", "a")}
    assert siblings < set(control.expect.equal) and "loss" not in control.expect.differs + control.expect.equal
    order = [s.name for s in control.output_specs()]
    flipped = order.index("module.model.layers.0.linear_attn.in_proj_z")
    assert all(order.index(name) < flipped or name in siblings for name in control.expect.equal)
    assert all(order.index(name) >= flipped for name in control.expect.differs)


@pytest.mark.skipif(absent("torch", "transformers"), reason="transformers builds the model")
def test_hf_gives_every_parameter_a_gradient_on_its_torch_paths():
    """Why the layout has a gradient for every tensor: transformers' GDN on its torch paths (no fla here) reaches
    each, A_log and dt_bias too (fp32, 8 tokens)."""
    import torch

    from harness.runners.torch import hf_families

    m = Qwen35Config.resolve(TINY)
    hf = hf_families.modeling(m)
    assert not hf.is_fast_path_available  # the torch paths, as the knob says for this CPU
    config = hf_families.hf_config(m, hf)
    torch.manual_seed(0)
    model = hf.Qwen3_5MoeForCausalLM(config)
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert sorted(n for n, p in model.named_parameters() if p.grad is None) == []


@pytest.mark.skipif(absent("torch", "transformers"), reason="transformers' modules are compared")
def test_the_float64_islands_keep_hfs_formulas_for_the_zero_centred_norm_and_m_rope():
    """In float64 the room's RMSNorm must be Qwen3.5's zero-centred one (a plain one would be off by the weight,
    O(1)) and its RoPE tables must read M-RoPE's three equal text rows; each agrees with HF's float32 result to float32
    rounding, and rows that differ (an image's positions) are refused."""
    import torch

    from harness.runners.torch import hf_families, hf_float64

    m = Qwen35Config.resolve(TINY)
    hf = hf_families.modeling(m)
    config = hf_families.hf_config(m, hf)
    norm = hf.Qwen3_5MoeRMSNorm(64, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    theirs = norm(x)  # HF: float32 inside
    rotary = hf.Qwen3_5MoeTextRotaryEmbedding(config=config)
    positions = torch.arange(6).view(1, 1, 6).expand(3, 1, 6)
    cos32, sin32 = rotary(x, positions)
    with hf_families.float64_mode(hf, m):
        ours = norm(x)
        outer = torch.nn.Module()  # a stand-in for the causal LM: the room makes outer.model.rotary_emb
        outer.model = torch.nn.Module()
        hf_families.rotary(outer, hf, m, config, "cpu", torch.float64)
    assert (ours - theirs).abs().max() < 1e-5 < (hf_float64.rms_norm(
        type("Plain", (), {"weight": norm.weight, "variance_epsilon": 1e-6})(), x) - ours).abs().max()
    rotary64 = hf.Qwen3_5MoeTextRotaryEmbedding(config=config)
    hf_float64.default_rope(rotary64, config)
    cos64, sin64 = rotary64.forward(x, positions)
    assert cos64.dtype == torch.float64 and cos64.shape == cos32.shape
    assert (cos64 - cos32).abs().max() < 1e-6 and (sin64 - sin32).abs().max() < 1e-6
    image = positions.clone()
    image[1, 0, 3] = 0
    with pytest.raises(ValueError, match="M-RoPE position rows differ"):
        rotary64.forward(x, image)


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron room imports megatron.core")
@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="flash-linear-attention is installed (a GPU)")
def test_megatron_refuses_gdn_layers_naming_flash_linear_attention():
    import torch

    from harness.runners.megatron import families

    with pytest.raises(Unsupported, match="Gated DeltaNet layers need flash-linear-attention"):
        families.translate_config(model_config(TINY_MODELS["qwen3_5_moe"]), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(absent("paddleformers"), reason="the Paddle room reads PaddleFormers' installed source")
def test_paddle_refuses_naming_the_paddlefleet_builder_of_the_vl_model():
    from harness.runners.paddle import families as room

    with pytest.raises(Unsupported, match=r"Qwen3.5-MoE has no dygraph model in PaddleFormers .*"
                                          r"Qwen3_5MoEForConditionalGeneration.*build_qwen3_5_model"):
        room.classes(model_config(TINY_MODELS["qwen3_5_moe"]))


# For tests/test_model_e2e.py: a planted float64 difference in a GDN input projection (a tensor only this family has)
# must be a mapping error naming module.model.layers.0.linear_attn.in_proj_b.
PLANTED_FLOAT64 = ("qwen3_5_moe_2layer_float64", "model.layers.0.linear_attn.in_proj_b.weight", (3, 5))
