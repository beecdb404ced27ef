"""Qwen3-MoE's tensors in canonical (HF checkpoint) names: every parameter (there is no buffer), the gradients (gate
and up fused as Megatron fuses them; q, k and v apart, as HF and the checkpoint hold them) and the module outputs, in
the order a step makes them."""

from __future__ import annotations

from harness.case.specs import FLOAT32_OR_WIDER, TensorSpec
from harness.families import tensors
from harness.families.qwen3_moe.config import Qwen3MoeConfig


def dense_layers(m: Qwen3MoeConfig) -> list[int]:
    return [layer for layer in range(m.num_hidden_layers) if not m.is_moe(layer)]


def moe_layers(m: Qwen3MoeConfig) -> list[int]:
    return [layer for layer in range(m.num_hidden_layers) if m.is_moe(layer)]


def routed_experts(m: Qwen3MoeConfig) -> int:
    return m.num_experts


def interleave(m: Qwen3MoeConfig) -> tuple[int, tuple[int, int, int]]:
    """How Megatron's linear_qkv and Paddle's qkv_proj fuse q, k and v: per key/value head (query group), that group's
    heads / groups query heads, then its key head, then its value head (Megatron Bridge's QKVMapping /
    merge_qkv_weights, conversion/param_mapping.py @ 0f418defd83bb8b007f00748e822b3e758ec2593, which its
    Qwen3MoEBridge uses; PaddleFormers' Qwen3MoeAttention splits its qkv_proj output the same way)."""
    groups, d = m.num_key_value_heads, m.head_dim
    return groups, (m.num_attention_heads // groups * d, d, d)


def parameters(m: Qwen3MoeConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF checkpoint name, shape, kind) of every parameter in forward order; kind: linear | norm | embedding |
    router. No buffer (the softmax router has no routing bias) and no bias (attention_bias is false)."""
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    params = [("model.embed_tokens.weight", (m.vocab_size, h), "embedding")]
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}."
        params.append((p + "input_layernorm.weight", (h,), "norm"))
        params += [(p + f"self_attn.{name}.weight", (width, h), "linear")
                   for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        params += [(p + "self_attn.q_norm.weight", (d,), "norm"), (p + "self_attn.k_norm.weight", (d,), "norm"),
                   (p + "self_attn.o_proj.weight", (h, q), "linear"),
                   (p + "post_attention_layernorm.weight", (h,), "norm")]
        if not m.is_moe(layer):
            f = m.intermediate_size
            params += [(p + f"mlp.{n}_proj.weight", (f, h), "linear") for n in ("gate", "up")]
            params.append((p + "mlp.down_proj.weight", (h, f), "linear"))
            continue
        e, f = m.num_experts, m.moe_intermediate_size
        params.append((p + "mlp.gate.weight", (e, h), "router"))
        for expert in range(e):
            x = p + f"mlp.experts.{expert}."
            params += [(x + "gate_proj.weight", (f, h), "linear"), (x + "up_proj.weight", (f, h), "linear"),
                       (x + "down_proj.weight", (h, f), "linear")]
    params += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (m.vocab_size, h), "linear")]
    return params


def gradients(m: Qwen3MoeConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical gradient names and shapes, in backward order (harness.families.tensors)."""
    return tensors.gradients(parameters(m))


def modules(m: Qwen3MoeConfig, tokens: int) -> list[TensorSpec]:
    """Module outputs in forward order (canonical HF module paths). q_norm and k_norm keep their heads apart
    ([T, heads, head_dim]: each head normalised alone, as all three stacks compute them). A MoE layer: the routing
    (top-k indices, probabilities after the top-k renormalisation), each routed expert's output, the MoE output (no
    shared expert)."""
    h, d, t = m.hidden_size, m.head_dim, tokens
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    specs = [TensorSpec("module.model.embed_tokens", (t, h), "output")]
    for layer in range(m.num_hidden_layers):
        p = f"module.model.layers.{layer}."
        specs += [TensorSpec(p + "input_layernorm", (t, h), "output")]
        specs += [TensorSpec(p + f"self_attn.{name}", (t, width), "output")
                  for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        specs += [TensorSpec(p + "self_attn.q_norm", (t, m.num_attention_heads, d), "output"),
                  TensorSpec(p + "self_attn.k_norm", (t, m.num_key_value_heads, d), "output"),
                  TensorSpec(p + "self_attn.core_attention", (t, q), "output"),
                  TensorSpec(p + "self_attn.o_proj", (t, h), "output"),
                  TensorSpec(p + "post_attention_layernorm", (t, h), "output")]
        if not m.is_moe(layer):
            f = m.intermediate_size
            specs += [TensorSpec(p + "mlp.gate_up_proj", (t, 2 * f), "output"),
                      TensorSpec(p + "mlp.act", (t, f), "output"), TensorSpec(p + "mlp.down_proj", (t, h), "output")]
        else:
            e = m.num_experts
            specs += [TensorSpec(p + "mlp.gate.topk_indices", (t, m.num_experts_per_tok), "output", "int64"),
                      TensorSpec(p + "mlp.gate.probs", (t, e), "output", FLOAT32_OR_WIDER)]
            specs += [TensorSpec(p + f"mlp.experts.{x}", (-1, h), "output", optional=True) for x in range(e)]
            specs.append(TensorSpec(p + "mlp", (t, h), "output"))
        specs.append(TensorSpec(p.rstrip("."), (t, h), "output"))
    specs.append(TensorSpec("module.model.norm", (t, h), "output"))
    return specs
