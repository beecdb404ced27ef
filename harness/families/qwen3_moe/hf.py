"""Qwen3-MoE in HF transformers (torch): transformers' own ``Qwen3MoeForCausalLM`` (read and pinned: transformers
5.3.0), its config from the case's (every key given: HF's defaults for norm_topk_prob, head_dim and the RoPE base are
not Qwen3-30B-A3B's), its routing as ``Qwen3MoeTopKRouter`` returns it, and its float64 mode.
``harness.runners.torch.hf_model`` builds, loads and runs it.

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

from harness.families import FamilyConfig as Qwen3MoeConfig
from harness.families import family_of
from harness.runners.torch import hf_float64

_FAMILY = family_of('qwen3_moe')  # transitional: the family's layout, until this builder moves to its room
moe_layers = _FAMILY.moe_layers

MODEL = "Qwen3MoeForCausalLM"
# This family's knobs (harness.runners.torch.hf_model has the rest), each written to meta.json
KNOBS = {
    "rope_parameters": ("default, rope_theta from the case", "transformers 5 reads RoPE settings from "
                        "rope_parameters only"),
    "output_router_logits": (False, "no load-balancing loss added to the LM loss (the real config's value; the "
                                    "harness compares the LM loss alone)"),
}


def modeling():
    """transformers' Qwen3Moe modeling module (imported when a run asks for it)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    return modeling_qwen3_moe


def build(hf, m: Qwen3MoeConfig):
    """(Qwen3MoeForCausalLM on the meta device, its transformers config): the runner loads every tensor."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        return hf.Qwen3MoeForCausalLM(config), config


def hf_config(m: Qwen3MoeConfig, hf):
    """transformers' Qwen3MoeConfig from the case's typed config (HF key names; rope_theta becomes rope_parameters,
    head_dim a keyword transformers keeps as an attribute)."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "norm_topk_prob", "decoder_sparse_step", "attention_bias", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "use_sliding_window")
    config = hf.Qwen3MoeConfig(**{k: getattr(m, k) for k in keys}, mlp_only_layers=list(m.mlp_only_layers),
                               rope_parameters=rope, output_router_logits=False, attention_dropout=0.0,
                               use_cache=False, pad_token_id=None, attn_implementation="eager",
                               experts_implementation="eager")
    if config.head_dim != m.head_dim or config.norm_topk_prob != m.norm_topk_prob:  # kept as given (5.3.0)
        raise RuntimeError(f"transformers' Qwen3MoeConfig did not keep head_dim {m.head_dim} / norm_topk_prob "
                           f"{m.norm_topk_prob} (got {config.head_dim}, {config.norm_topk_prob})")
    return config


def rotary(model, hf, config, device, dtype: torch.dtype) -> None:
    """The RoPE module made on `device` (its tables are buffers the checkpoint does not hold); in float64 its tables
    in float64."""
    model.model.rotary_emb = hf.Qwen3MoeRotaryEmbedding(config=config, device=device)
    if dtype == torch.float64:
        hf_float64.default_rope(model.model.rotary_emb, config)


def record_routing(model, m: Qwen3MoeConfig) -> dict:
    """{MoE layer: (top-k indices, renormalised weights)} as each layer's Qwen3MoeTopKRouter returns them (its second
    and third outputs), filled in by the forward through a forward hook, unchanged."""
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
    """Qwen3MoeTopKRouter.forward (transformers 5.3.0) with the softmax in the model's dtype (HF: float32): in a
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
        (hf.Qwen3MoeRMSNorm, "forward", hf_float64.rms_norm, "Qwen3MoeRMSNorm.forward",
         "normalises in float64 (HF: float32)"),
        (hf.Qwen3MoeTopKRouter, "forward", router_forward, "Qwen3MoeTopKRouter.forward",
         "softmax over the experts in float64 (HF: float32)"),
        (hf, "eager_attention_forward", hf_float64.eager_attention(hf), "eager_attention_forward",
         "softmax in float64 (HF: float32)"),
    ], on) as replaced:
        if on:
            replaced = {**replaced,
                        "Qwen3MoeRotaryEmbedding": "inverse frequencies and cos/sin tables in float64 (HF: float32)",
                        "loss": "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 "
                                "first)"}
        yield replaced
