"""MiniMax-M2 in HF transformers (torch): transformers' own ``MiniMaxM2ForCausalLM`` (read and pinned: transformers
5.3.0), its config from the case's with every key given, its routing as the router returns it, and its float64 mode.
``harness.runners.torch.hf_model`` builds, loads and runs it.

Partial rotary: transformers 5.3.0's ``MiniMaxM2Config`` ignores the checkpoints' ``rotary_dim`` (it stays an opaque
attribute and ``rope_parameters`` gets no partial factor, so a real ``config.json`` runs full-head RoPE:
huggingface/transformers issue #48241, fixed after 5.3.0 by PR #48486). The harness passes
``rope_parameters.partial_rotary_factor = rotary_dim / head_dim`` itself and refuses a transformers that does not keep
it. The routing bias ``mlp.e_score_correction_bias`` is a plain buffer in transformers (no
``_keep_in_fp32_modules``: a bf16 model would make it bf16); the runner loads it in float32 as the family's buffer
(``Family.buffers``), so the router adds a float32 bias to float32 scores as the checkpoint holds it.

Float64 (the truth and the semantic check): HF computes RMSNorm, the router's sigmoid, the RoPE tables, the attention
softmax and the loss in float32 whatever the model's dtype. In a float64 request the runner replaces exactly those
with the same formulas in float64 (``harness.runners.torch.hf_float64`` and ``router_float64`` here, listed in
meta.json under ``float64_mode``); nothing changes for bfloat16 and float32, and HF's own code is back when the cell
ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from harness.families import FamilyConfig as MiniMaxM2Config
from harness.families import family_of
from harness.runners.torch import hf_float64

_FAMILY = family_of('minimax_m2')  # transitional: the family's layout, until this builder moves to its room
moe_layers = _FAMILY.moe_layers

MODEL = "MiniMaxM2ForCausalLM"
# This family's knobs (harness.runners.torch.hf_model has the rest), each written to meta.json
KNOBS = {
    "e_score_correction_bias": ("float32", "the checkpoint's float32 routing bias kept float32 (transformers 5.3.0 "
                                           "has no _keep_in_fp32_modules for it); float64 in a float64 run"),
    "rope_parameters": ("default, partial_rotary_factor = rotary_dim / head_dim, rope_theta from the case",
                        "transformers 5.3.0 ignores MiniMax-M2's rotary_dim (huggingface/transformers#48241): the "
                        "partial factor is passed explicitly"),
    "router_jitter_noise": (0.0, "no multiplicative noise on the router input in training (MiniMax-M2's 0.0)"),
    "output_router_logits": (False, "no auxiliary load-balancing loss (router_aux_loss_coef unused)"),
}


def modeling():
    """transformers' MiniMaxM2 modeling module (imported when a run asks for it)."""
    from transformers.models.minimax_m2 import modeling_minimax_m2

    return modeling_minimax_m2


def build(hf, m: MiniMaxM2Config):
    """(MiniMaxM2ForCausalLM on the meta device, its transformers config): the runner loads every tensor."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        return hf.MiniMaxM2ForCausalLM(config), config


def hf_config(m: MiniMaxM2Config, hf):
    """transformers' MiniMaxM2Config from the case's typed config: every key it reads given (rope_theta and the
    partial factor as rope_parameters); the checkpoint keys it does not read are the fixed values the model has."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta, "partial_rotary_factor": (m.rotary_dim / m.head_dim)}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "num_experts_per_tok", "num_local_experts")
    config = hf.MiniMaxM2Config(**{k: getattr(m, k) for k in keys}, rope_parameters=rope, attention_dropout=0.0,
                                router_jitter_noise=0.0, output_router_logits=False, use_cache=False,
                                pad_token_id=None, attn_implementation="eager", experts_implementation="eager")
    if config.head_dim != m.head_dim or config.rope_parameters.get("partial_rotary_factor") != \
            (m.rotary_dim / m.head_dim):  # transformers 5.3.0 keeps both as given; one that drops them: refuse
        raise RuntimeError(f"transformers' MiniMaxM2Config did not keep head_dim {m.head_dim} / partial_rotary_factor "
                           f"{(m.rotary_dim / m.head_dim)} (got {config.head_dim}, {config.rope_parameters})")
    return config


def rotary(model, hf, config, device, dtype: torch.dtype) -> None:
    """The RoPE module made on `device` (its tables are buffers the checkpoint does not hold); in float64 its tables
    in float64."""
    model.model.rotary_emb = hf.MiniMaxM2RotaryEmbedding(config=config, device=device)
    if dtype == torch.float64:
        hf_float64.default_rope(model.model.rotary_emb, config)


def record_routing(model, m: MiniMaxM2Config) -> dict:
    """{MoE layer: (top-k indices, normalised weights)} as each layer's router returns them
    (``MiniMaxM2TopKRouter.forward`` -> (logits, weights, indices)), filled in by the forward, unchanged."""
    gates = {}
    for layer in moe_layers(m):
        _record_routing(model.model.layers[layer].mlp.gate, layer, gates)
    return gates


def _record_routing(router, layer: int, gates: dict) -> None:
    def hook(module, args, output):
        _, weights, indices = output
        gates[layer] = (indices.detach().clone(), weights.detach().clone())

    router.register_forward_hook(hook)


def router_float64(self, hidden_states, e_score_correction_bias):
    """``MiniMaxM2TopKRouter.forward`` with the sigmoid in float64 (HF: ``sigmoid(router_logits.float())``): the same
    steps, the gating GEMM in the weight's dtype (float64 here)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
    routing_weights = torch.sigmoid(router_logits.to(torch.float64))
    scores_for_choice = routing_weights + e_score_correction_bias
    _, top_k_index = torch.topk(scores_for_choice, self.top_k, dim=-1, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    return router_logits, top_k_weights, top_k_index


@contextmanager
def float64_mode(hf, on: bool = True) -> Iterator[dict]:
    """Inside: HF's RMSNorm (q_norm and k_norm included), the router's sigmoid and eager attention in float64 (when
    `on`); yields {what: how} for meta.json (the RoPE tables: ``rotary``; the loss: the runner)."""
    with hf_float64.islands([
        (hf.MiniMaxM2RMSNorm, "forward", hf_float64.rms_norm, "MiniMaxM2RMSNorm.forward",
         "normalises in float64 (HF: float32), q_norm and k_norm included"),
        (hf.MiniMaxM2TopKRouter, "forward", router_float64, "MiniMaxM2TopKRouter.forward",
         "sigmoid of the router logits in float64 (HF: float32)"),
        (hf, "eager_attention_forward", hf_float64.eager_attention(hf), "eager_attention_forward",
         "softmax in float64 (HF: float32)"),
    ], on) as replaced:
        if on:
            replaced = {**replaced,
                        "MiniMaxM2RotaryEmbedding": "inverse frequencies and cos/sin tables in float64 (HF: float32)",
                        "loss": "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 "
                                "first)"}
        yield replaced
