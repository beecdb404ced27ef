"""GLM-4.5 MoE in HF transformers (torch): transformers' own ``Glm4MoeForCausalLM`` (read and pinned: transformers
5.3.0), its config from the case's (every key given: HF's defaults for attention_bias, rope_theta and head_dim are
not GLM-4.5's), its routing as ``route_tokens_to_experts`` returns it, and its float64 mode.
``harness.runners.torch.hf_model`` builds, loads and runs it.

Float64 (the truth and the semantic check): HF computes RMSNorm, the router GEMM, the RoPE tables, the attention
softmax and the loss in float32 whatever the model's dtype. In a float64 request the runner replaces exactly those
with the same formulas in float64 (``harness.runners.torch.hf_float64``, listed in meta.json under
``float64_mode``); nothing changes for bfloat16 and float32, and HF's own code is back when the cell ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from harness.families import FamilyConfig as Glm4MoeConfig
from harness.families import family_of
from harness.runners.torch import hf_float64

_FAMILY = family_of('glm4_moe')  # transitional: the family's layout, until this builder moves to its room
moe_layers = _FAMILY.moe_layers

MODEL = "Glm4MoeForCausalLM"
# This family's knobs (harness.runners.torch.hf_model has the rest), each written to meta.json
KNOBS = {
    "e_score_correction_bias": ("float32", "HF keeps it in float32 (_keep_in_fp32_modules_strict); float64 in a "
                                          "float64 run"),
    "rope_parameters": ("default, partial_rotary_factor and rope_theta from the case", "transformers 5 reads RoPE "
                        "settings from rope_parameters only"),
}


def modeling():
    """transformers' Glm4Moe modeling module (imported when a run asks for it)."""
    from transformers.models.glm4_moe import modeling_glm4_moe

    return modeling_glm4_moe


def build(hf, m: Glm4MoeConfig):
    """(Glm4MoeForCausalLM on the meta device, its transformers config): the runner loads every tensor."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        return hf.Glm4MoeForCausalLM(config), config


def hf_config(m: Glm4MoeConfig, hf):
    """transformers' Glm4MoeConfig from the case's typed config (HF key names; rope_theta and partial_rotary_factor
    become rope_parameters, head_dim a keyword transformers keeps as an attribute)."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta, "partial_rotary_factor": m.partial_rotary_factor}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
            "norm_topk_prob", "use_qk_norm", "attention_bias", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings")
    config = hf.Glm4MoeConfig(**{k: getattr(m, k) for k in keys}, rope_parameters=rope,
                              partial_rotary_factor=m.partial_rotary_factor, attention_dropout=0.0, use_cache=False,
                              pad_token_id=None, attn_implementation="eager", experts_implementation="eager")
    if config.head_dim != m.head_dim or config.rope_parameters.get("partial_rotary_factor") != \
            m.partial_rotary_factor:  # transformers keeps both as given (5.3.0); a later one that drops them: refuse
        raise RuntimeError(f"transformers' Glm4MoeConfig did not keep head_dim {m.head_dim} / partial_rotary_factor "
                           f"{m.partial_rotary_factor} (got {config.head_dim}, {config.rope_parameters})")
    return config


def rotary(model, hf, config, device, dtype: torch.dtype) -> None:
    """The RoPE module made on `device` (its tables are buffers the checkpoint does not hold); in float64 its tables
    in float64."""
    model.model.rotary_emb = hf.Glm4MoeRotaryEmbedding(config=config, device=device)
    if dtype == torch.float64:
        hf_float64.default_rope(model.model.rotary_emb, config)


def record_routing(model, m: Glm4MoeConfig) -> dict:
    """{MoE layer: (top-k indices, scaled weights)} as each layer's route_tokens_to_experts returns them, filled in
    by the forward, unchanged."""
    gates = {}
    for layer in moe_layers(m):
        _record_routing(model.model.layers[layer].mlp, layer, gates)
    return gates


def _record_routing(moe, layer: int, gates: dict) -> None:
    original = moe.route_tokens_to_experts

    def routed(router_logits):
        indices, weights = original(router_logits)
        gates[layer] = (indices.detach().clone(), weights.detach().clone())
        return indices, weights

    moe.route_tokens_to_experts = routed


@contextmanager
def float64_mode(hf, on: bool = True) -> Iterator[dict]:
    """Inside: HF's RMSNorm, router GEMM and eager attention in float64 (when `on`); yields {what: how} for
    meta.json (the RoPE tables: ``rotary``; the loss: the runner)."""
    with hf_float64.islands([
        (hf.Glm4MoeRMSNorm, "forward", hf_float64.rms_norm, "Glm4MoeRMSNorm.forward",
         "normalises in float64 (HF: float32)"),
        (hf.Glm4MoeTopkRouter, "forward", hf_float64.router_gemm, "Glm4MoeTopkRouter.forward",
         "router GEMM in float64 (HF: float32)"),
        (hf, "eager_attention_forward", hf_float64.eager_attention(hf), "eager_attention_forward",
         "softmax in float64 (HF: float32)"),
    ], on) as replaced:
        if on:
            replaced = {**replaced,
                        "Glm4MoeRotaryEmbedding": "inverse frequencies and cos/sin tables in float64 (HF: float32)",
                        "loss": "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 "
                                "first)"}
        yield replaced
