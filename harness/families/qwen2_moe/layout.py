"""Qwen2-MoE's tensors in canonical (HF checkpoint) names: every parameter (there is no buffer), the gradients (gate
and up fused as Megatron fuses them, in the routed experts and the shared expert; q, k and v apart, weights and
biases, as HF and the checkpoint hold them) and the module outputs, in the order a step makes them."""

from __future__ import annotations

from harness.case.specs import FLOAT32_OR_WIDER, TensorSpec
from harness.families import tensors
from harness.families.qwen2_moe.config import Qwen2MoeConfig


def dense_layers(m: Qwen2MoeConfig) -> list[int]:
    return [layer for layer in range(m.num_hidden_layers) if not m.is_moe(layer)]


def moe_layers(m: Qwen2MoeConfig) -> list[int]:
    return [layer for layer in range(m.num_hidden_layers) if m.is_moe(layer)]


def routed_experts(m: Qwen2MoeConfig) -> int:
    return m.num_experts


def interleave(m: Qwen2MoeConfig) -> tuple[int, tuple[int, int, int]]:
    """How Megatron's linear_qkv and Paddle's qkv_proj fuse q, k and v (weights and biases): per key/value head (query
    group), that group's heads / groups query heads, then its key head, then its value head (Megatron Bridge's
    QKVMapping / merge_qkv_weights and merge_qkv_biases, conversion/param_mapping.py @
    0f418defd83bb8b007f00748e822b3e758ec2593; PaddleFormers' Qwen2MoeAttention splits its qkv_proj output the same
    way). Qwen1.5-MoE-A2.7B is multi-head: one query head a group."""
    groups, d = m.num_key_value_heads, m.head_dim
    return groups, (m.num_attention_heads // groups * d, d, d)


def parameters(m: Qwen2MoeConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF checkpoint name, shape, kind) of every parameter in forward order; kind: linear | bias | norm | embedding |
    router. No buffer (the softmax router has no routing bias). A MoE layer: the router, the routed experts, the shared
    expert, then its gate (shared_expert_gate, [1, hidden])."""
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    params = [("model.embed_tokens.weight", (m.vocab_size, h), "embedding")]
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}."
        params.append((p + "input_layernorm.weight", (h,), "norm"))
        for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            params.append((p + f"self_attn.{name}.weight", (width, h), "linear"))
            params.append((p + f"self_attn.{name}.bias", (width,), "bias"))
        params += [(p + "self_attn.o_proj.weight", (h, q), "linear"),
                   (p + "post_attention_layernorm.weight", (h,), "norm")]
        if not m.is_moe(layer):
            f = m.intermediate_size
            params += [(p + f"mlp.{n}_proj.weight", (f, h), "linear") for n in ("gate", "up")]
            params.append((p + "mlp.down_proj.weight", (h, f), "linear"))
            continue
        e, f, fs = m.num_experts, m.moe_intermediate_size, m.shared_expert_intermediate_size
        params.append((p + "mlp.gate.weight", (e, h), "router"))
        for expert in range(e):
            x = p + f"mlp.experts.{expert}."
            params += [(x + "gate_proj.weight", (f, h), "linear"), (x + "up_proj.weight", (f, h), "linear"),
                       (x + "down_proj.weight", (h, f), "linear")]
        params += [(p + f"mlp.shared_expert.{n}_proj.weight", (fs, h), "linear") for n in ("gate", "up")]
        params += [(p + "mlp.shared_expert.down_proj.weight", (h, fs), "linear"),
                   (p + "mlp.shared_expert_gate.weight", (1, h), "linear")]
    params += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (m.vocab_size, h), "linear")]
    return params


def gradients(m: Qwen2MoeConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical gradient names and shapes, in backward order (harness.families.tensors)."""
    return tensors.gradients(parameters(m))


def modules(m: Qwen2MoeConfig, tokens: int) -> list[TensorSpec]:
    """Module outputs in forward order (canonical HF module paths). A MoE layer: the routing (top-k indices, the
    softmax probabilities of the chosen experts, not renormalised), each routed expert's output, the shared expert's
    output before its gate, the gate's logit ([T, 1], before the sigmoid), the MoE output (routed + gated shared)."""
    h, d, t = m.hidden_size, m.head_dim, tokens
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    specs = [TensorSpec("module.model.embed_tokens", (t, h), "output")]
    for layer in range(m.num_hidden_layers):
        p = f"module.model.layers.{layer}."
        specs += [TensorSpec(p + "input_layernorm", (t, h), "output")]
        specs += [TensorSpec(p + f"self_attn.{name}", (t, width), "output")
                  for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        specs += [TensorSpec(p + "self_attn.core_attention", (t, q), "output"),
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
            specs += [TensorSpec(p + "mlp.shared_expert", (t, h), "output"),
                      TensorSpec(p + "mlp.shared_expert_gate", (t, 1), "output", optional=True),
                      TensorSpec(p + "mlp", (t, h), "output")]
        specs.append(TensorSpec(p.rstrip("."), (t, h), "output"))
    specs.append(TensorSpec("module.model.norm", (t, h), "output"))
    return specs
