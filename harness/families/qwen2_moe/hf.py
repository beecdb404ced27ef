"""Qwen2-MoE in HF transformers (torch): transformers' own ``Qwen2MoeForCausalLM`` (read and pinned: transformers
5.3.0), its config from the case's (every key given: PaddleFormers' and older defaults are not Qwen1.5-MoE-A2.7B's),
its routing as ``Qwen2MoeTopKRouter`` returns it, and its float64 mode. ``harness.runners.torch.hf_model`` builds,
loads and runs it.

The MoE block (``Qwen2MoeSparseMoeBlock.forward``): the shared expert on every token, the router (softmax over all
experts in float32, top-k, renormalised only with norm_topk_prob), the routed experts, then
``sigmoid(shared_expert_gate(x)) * shared_expert_output`` added to the routed experts' sum.

Float64 (the truth and the semantic check): HF computes RMSNorm, the router's softmax, the RoPE tables, the attention
softmax and the loss in float32 whatever the model's dtype. In a float64 request the runner replaces exactly those
with the same formulas in float64 (``harness.runners.torch.hf_float64`` and ``router_forward`` here, listed in
meta.json under ``float64_mode``); nothing changes for bfloat16 and float32, and HF's own code is back when the cell
ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from harness.families import FamilyConfig as Qwen2MoeConfig
from harness.families import family_of
from harness.runners.torch import hf_float64

_FAMILY = family_of('qwen2_moe')  # transitional: the family's layout, until this builder moves to its room
moe_layers = _FAMILY.moe_layers

MODEL = "Qwen2MoeForCausalLM"
# This family's knobs (harness.runners.torch.hf_model has the rest), each written to meta.json
KNOBS = {
    "rope_parameters": ("default, rope_theta from the case", "transformers 5 reads RoPE settings from "
                        "rope_parameters only"),
    "output_router_logits": (False, "no load-balancing loss added to the LM loss (the real config's value; the "
                                    "harness compares the LM loss alone)"),
}


def modeling():
    """transformers' Qwen2Moe modeling module (imported when a run asks for it)."""
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    return modeling_qwen2_moe


def build(hf, m: Qwen2MoeConfig):
    """(Qwen2MoeForCausalLM on the meta device, its transformers config): the runner loads every tensor."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        return hf.Qwen2MoeForCausalLM(config), config


def hf_config(m: Qwen2MoeConfig, hf):
    """transformers' Qwen2MoeConfig from the case's typed config (HF key names; rope_theta becomes
    rope_parameters)."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "qkv_bias", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "use_sliding_window")
    config = hf.Qwen2MoeConfig(**{k: getattr(m, k) for k in keys}, mlp_only_layers=list(m.mlp_only_layers),
                               rope_parameters=rope, output_router_logits=False, attention_dropout=0.0,
                               use_cache=False, pad_token_id=None, attn_implementation="eager",
                               experts_implementation="eager")
    if config.qkv_bias != m.qkv_bias or config.norm_topk_prob != m.norm_topk_prob:  # kept as given (5.3.0)
        raise RuntimeError(f"transformers' Qwen2MoeConfig did not keep qkv_bias {m.qkv_bias} / norm_topk_prob "
                           f"{m.norm_topk_prob} (got {config.qkv_bias}, {config.norm_topk_prob})")
    return config


def rotary(model, hf, config, device, dtype: torch.dtype) -> None:
    """The RoPE module made on `device` (its tables are buffers the checkpoint does not hold); in float64 its tables
    in float64."""
    model.model.rotary_emb = hf.Qwen2MoeRotaryEmbedding(config=config, device=device)
    if dtype == torch.float64:
        hf_float64.default_rope(model.model.rotary_emb, config)


def record_routing(model, m: Qwen2MoeConfig) -> dict:
    """{MoE layer: (top-k indices, top-k weights)} as each layer's Qwen2MoeTopKRouter returns them (its second and
    third outputs), filled in by the forward through a forward hook, unchanged."""
    gates = {}
    for layer in moe_layers(m):
        model.model.layers[layer].mlp.gate.register_forward_hook(_recorder(layer, gates))
    return gates


def _recorder(layer: int, gates: dict):
    def hook(_module, _args, output):
        _, weights, indices = output  # (softmax over all experts [T, E], top-k weights [T, k], indices [T, k])
        gates[layer] = (indices.detach().clone(), weights.detach().clone())
    return hook


def router_forward(self, hidden_states):
    """Qwen2MoeTopKRouter.forward (transformers 5.3.0) with the softmax in the model's dtype (HF: float32): in a
    float64 run, float64."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_logits = torch.nn.functional.softmax(router_logits, dtype=hidden_states.dtype, dim=-1)
    router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
    if self.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


@contextmanager
def float64_mode(hf, on: bool = True) -> Iterator[dict]:
    """Inside: HF's RMSNorm, router softmax and eager attention in float64 (when `on`); yields {what: how} for
    meta.json (the RoPE tables: ``rotary``; the loss: the runner)."""
    with hf_float64.islands([
        (hf.Qwen2MoeRMSNorm, "forward", hf_float64.rms_norm, "Qwen2MoeRMSNorm.forward",
         "normalises in float64 (HF: float32)"),
        (hf.Qwen2MoeTopKRouter, "forward", router_forward, "Qwen2MoeTopKRouter.forward",
         "softmax over the experts in float64 (HF: float32)"),
        (hf, "eager_attention_forward", hf_float64.eager_attention(hf), "eager_attention_forward",
         "softmax in float64 (HF: float32)"),
    ], on) as replaced:
        if on:
            replaced = {**replaced,
                        "Qwen2MoeRotaryEmbedding": "inverse frequencies and cos/sin tables in float64 (HF: float32)",
                        "loss": "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 "
                                "first)"}
        yield replaced
