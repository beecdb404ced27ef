"""DeepSeek-V3's tensors in canonical (HF checkpoint) names: every parameter and buffer, the gradients (gate and up
fused as Megatron fuses them) and the module outputs, in the order a step makes them."""

from __future__ import annotations

from harness.case.specs import FLOAT32_OR_WIDER, TensorSpec
from harness.families import tensors
from harness.families.deepseek_v3.config import DeepseekV3Config


def dense_layers(m: DeepseekV3Config) -> list[int]:
    return list(range(min(m.first_k_dense_replace, m.num_hidden_layers)))


def moe_layers(m: DeepseekV3Config) -> list[int]:
    return list(range(m.first_k_dense_replace, m.num_hidden_layers))


def routed_experts(m: DeepseekV3Config) -> int:
    return m.n_routed_experts


def parameters(m: DeepseekV3Config) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF checkpoint name, shape, kind) of every parameter in forward order; kind: linear | norm | embedding |
    router | buffer (the routing bias, e_score_correction_bias)."""
    h, heads = m.hidden_size, m.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    params = [("model.embed_tokens.weight", (m.vocab_size, h), "embedding")]
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}."
        params += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_a_proj.weight", (m.q_lora_rank, h), "linear"),
            (p + "self_attn.q_a_layernorm.weight", (m.q_lora_rank,), "norm"),
            (p + "self_attn.q_b_proj.weight", (heads * qk, m.q_lora_rank), "linear"),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), "linear"),
            (p + "self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,), "norm"),
            (p + "self_attn.kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
             "linear"),
            (p + "self_attn.o_proj.weight", (h, heads * m.v_head_dim), "linear"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
        if layer < m.first_k_dense_replace:
            f = m.intermediate_size
            params += [(p + f"mlp.{n}_proj.weight", (f, h), "linear") for n in ("gate", "up")]
            params.append((p + "mlp.down_proj.weight", (h, f), "linear"))
            continue
        e, f, fs = m.n_routed_experts, m.moe_intermediate_size, m.moe_intermediate_size * m.n_shared_experts
        params += [(p + "mlp.gate.weight", (e, h), "router"),
                   (p + "mlp.gate.e_score_correction_bias", (e,), "buffer")]
        for expert in range(e):
            q = p + f"mlp.experts.{expert}."
            params += [(q + "gate_proj.weight", (f, h), "linear"), (q + "up_proj.weight", (f, h), "linear"),
                       (q + "down_proj.weight", (h, f), "linear")]
        params += [(p + f"mlp.shared_experts.{n}_proj.weight", (fs, h), "linear") for n in ("gate", "up")]
        params.append((p + "mlp.shared_experts.down_proj.weight", (h, fs), "linear"))
    params += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (m.vocab_size, h), "linear")]
    return params


def gradients(m: DeepseekV3Config) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical gradient names (gate and up fused as Megatron fuses them) and shapes, in backward order."""
    return tensors.gradients(parameters(m))


def modules(m: DeepseekV3Config, tokens: int) -> list[TensorSpec]:
    """Module outputs in forward order (canonical HF module paths)."""
    h, heads, t = m.hidden_size, m.num_attention_heads, tokens
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    probs_dtype = FLOAT32_OR_WIDER
    specs = [TensorSpec("module.model.embed_tokens", (t, h), "output")]
    for layer in range(m.num_hidden_layers):
        p = f"module.model.layers.{layer}."
        specs += [TensorSpec(p + name, (t, width), "output") for name, width in (
            ("input_layernorm", h), ("self_attn.q_a_proj", m.q_lora_rank),
            ("self_attn.q_a_layernorm", m.q_lora_rank), ("self_attn.q_b_proj", heads * qk),
            ("self_attn.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim),
            ("self_attn.kv_a_layernorm", m.kv_lora_rank),
            ("self_attn.kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim)),
            ("self_attn.core_attention", heads * m.v_head_dim), ("self_attn.o_proj", h),
            ("post_attention_layernorm", h))]
        if layer < m.first_k_dense_replace:
            f = m.intermediate_size
            specs += [TensorSpec(p + "mlp.gate_up_proj", (t, 2 * f), "output"),
                      TensorSpec(p + "mlp.act", (t, f), "output"), TensorSpec(p + "mlp.down_proj", (t, h), "output")]
        else:
            e = m.n_routed_experts
            specs += [TensorSpec(p + "mlp.gate.topk_indices", (t, m.num_experts_per_tok), "output", "int64"),
                      TensorSpec(p + "mlp.gate.probs", (t, e), "output", probs_dtype)]
            specs += [TensorSpec(p + f"mlp.experts.{x}", (-1, h), "output", optional=True) for x in range(e)]
            specs += [TensorSpec(p + "mlp.shared_experts", (t, h), "output"), TensorSpec(p + "mlp", (t, h), "output")]
        specs.append(TensorSpec(p.rstrip("."), (t, h), "output"))
    specs.append(TensorSpec("module.model.norm", (t, h), "output"))
    return specs
