"""MiniMax-M2's tensors in canonical names: every parameter and buffer, the gradients (gate and up fused as Megatron
fuses them; q, k and v apart) and the module outputs, in the order a step makes them.

Canonical names are transformers 5.3.0's module names (``MiniMaxM2ForCausalLM``: ``mlp.gate``, ``mlp.experts``,
``mlp.e_score_correction_bias``), with the routed experts per expert as every family of the harness names them
(``mlp.experts.{E}.gate_proj`` / ``up_proj`` / ``down_proj``: the tensors transformers stacks into its fused
``gate_up_proj`` / ``down_proj``). The released checkpoints name them Mixtral's way on disk
(``block_sparse_moe.gate``, ``block_sparse_moe.e_score_correction_bias``, ``block_sparse_moe.experts.{E}.w1`` (gate)
/ ``w3`` (up) / ``w2`` (down)); ``names.toml`` ``[disk]`` maps them (transformers 5.3.0 renames them so itself:
``conversion_mapping.py``, "mixtral" plus the minimax_m2 bias renaming).
"""

from __future__ import annotations

from harness.case.specs import FLOAT32_OR_WIDER, TensorSpec
from harness.families import tensors
from harness.families.minimax_m2.config import MiniMaxM2Config


def dense_layers(m: MiniMaxM2Config) -> list[int]:
    return []  # every layer is MoE


def moe_layers(m: MiniMaxM2Config) -> list[int]:
    return list(range(m.num_hidden_layers))


def routed_experts(m: MiniMaxM2Config) -> int:
    return m.num_local_experts


def interleave(m: MiniMaxM2Config) -> tuple[int, tuple[int, int, int]]:
    """How Megatron's linear_qkv fuses q, k and v: per key/value head (query group), that group's heads / groups
    query heads, then its key head, then its value head (Megatron Bridge merge_qkv_weights, conversion/
    param_mapping.py @ 0f418defd83bb8b007f00748e822b3e758ec2593, line 3143; the MiniMax-M2 bridge maps q/k/v with
    QKVMapping)."""
    groups, d = m.num_key_value_heads, m.head_dim
    return groups, (m.num_attention_heads // groups * d, d, d)


def parameters(m: MiniMaxM2Config) -> list[tuple[str, tuple[int, ...], str]]:
    """(canonical name, shape, kind) of every parameter in forward order; kind: linear | norm | embedding | router |
    buffer (the routing bias, e_score_correction_bias). q_norm and k_norm normalise all heads of a token at once:
    their weights are [heads x head_dim] and [kv_heads x head_dim]."""
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    e, f = m.num_local_experts, m.intermediate_size
    params = [("model.embed_tokens.weight", (m.vocab_size, h), "embedding")]
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}."
        params.append((p + "input_layernorm.weight", (h,), "norm"))
        params += [(p + f"self_attn.{name}.weight", (width, h), "linear")
                   for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        params += [(p + "self_attn.q_norm.weight", (q,), "norm"), (p + "self_attn.k_norm.weight", (kv,), "norm")]
        params += [(p + "self_attn.o_proj.weight", (h, q), "linear"),
                   (p + "post_attention_layernorm.weight", (h,), "norm")]
        params += [(p + "mlp.gate.weight", (e, h), "router"), (p + "mlp.e_score_correction_bias", (e,), "buffer")]
        for expert in range(e):
            x = p + f"mlp.experts.{expert}."
            params += [(x + "gate_proj.weight", (f, h), "linear"), (x + "up_proj.weight", (f, h), "linear"),
                       (x + "down_proj.weight", (h, f), "linear")]
    params += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (m.vocab_size, h), "linear")]
    return params


def gradients(m: MiniMaxM2Config) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical gradient names and shapes, in backward order (harness.families.tensors)."""
    return tensors.gradients(parameters(m))


def modules(m: MiniMaxM2Config, tokens: int) -> list[TensorSpec]:
    """Module outputs in forward order (canonical HF module paths). q_norm and k_norm are one norm over all heads of
    a token, as transformers computes them before the head split: [T, heads x head_dim] and [T, kv_heads x
    head_dim]."""
    h, d, t = m.hidden_size, m.head_dim, tokens
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    specs = [TensorSpec("module.model.embed_tokens", (t, h), "output")]
    for layer in range(m.num_hidden_layers):
        p = f"module.model.layers.{layer}."
        specs += [TensorSpec(p + "input_layernorm", (t, h), "output")]
        specs += [TensorSpec(p + f"self_attn.{name}", (t, width), "output")
                  for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("q_norm", q), ("k_norm", kv))]
        specs += [TensorSpec(p + "self_attn.core_attention", (t, q), "output"),
                  TensorSpec(p + "self_attn.o_proj", (t, h), "output"),
                  TensorSpec(p + "post_attention_layernorm", (t, h), "output")]
        e = m.num_local_experts
        specs += [TensorSpec(p + "mlp.gate.topk_indices", (t, m.num_experts_per_tok), "output", "int64"),
                  TensorSpec(p + "mlp.gate.probs", (t, e), "output", FLOAT32_OR_WIDER)]
        specs += [TensorSpec(p + f"mlp.experts.{x}", (-1, h), "output", optional=True) for x in range(e)]
        specs += [TensorSpec(p + "mlp", (t, h), "output"), TensorSpec(p.rstrip("."), (t, h), "output")]
    specs.append(TensorSpec("module.model.norm", (t, h), "output"))
    return specs
