"""DeepSeek-V3 in HF transformers (torch): transformers' own ``DeepseekV3ForCausalLM`` (read and pinned: transformers
5.3.0), its config from the case's, its routing as ``route_tokens_to_experts`` returns it, and its float64 mode.
``harness.runners.torch.hf_model`` builds, loads and runs it.

Float64 (the truth and the semantic check): HF computes RMSNorm, the router GEMM, the RoPE tables, the attention
softmax and the loss in float32 whatever the model's dtype. In a float64 request the runner replaces exactly those
five places with the same formulas in float64 (listed in meta.json under ``float64_mode``); nothing else changes,
and nothing changes at all for bfloat16 and float32. Three of them are class and module attributes of transformers:
``float64_mode`` puts HF's own back when the cell ends, so a worker's next cell runs HF's code.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from harness.families import FamilyConfig as DeepseekV3Config
from harness.families import family_of
from harness.run.cell_state import attribute_restored

_FAMILY = family_of('deepseek_v3')  # transitional: the family's layout, until this builder moves to its room
moe_layers = _FAMILY.moe_layers

MODEL = "DeepseekV3ForCausalLM"
# This family's knobs (harness.runners.torch.hf_model has the rest), each written to meta.json
KNOBS = {
    "e_score_correction_bias": ("float32", "HF keeps it in float32 (_keep_in_fp32_modules_strict); float64 in a "
                                          "float64 run"),
}


def modeling():
    """transformers' DeepseekV3 modeling module (imported when a run asks for it)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    return modeling_deepseek_v3


def build(hf, m: DeepseekV3Config):
    """(DeepseekV3ForCausalLM on the meta device, its transformers config): the runner loads every tensor."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        return hf.DeepseekV3ForCausalLM(config), config


def rotary(model, hf, config, device, dtype: torch.dtype) -> None:
    """The RoPE module made on `device` (its tables are buffers the checkpoint does not hold); in float64 its tables
    in float64."""
    model.model.rotary_emb = hf.DeepseekV3RotaryEmbedding(config=config, device=device)
    if dtype == torch.float64:
        _rotary_in_float64(model.model.rotary_emb, config)


def hf_config(m: DeepseekV3Config, hf):
    """transformers' DeepseekV3Config from the case's typed config (HF key names; rope_scaling becomes
    rope_parameters)."""
    scaling = m.rope_scaling
    rope = {"rope_type": scaling.type, "rope_theta": m.rope_theta, "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
            "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "attention_bias", "rope_interleave")
    # scoring_func = sigmoid and topk_method = noaux_tc are what DeepseekV3MoE hard-codes (the registry allows no other)
    return hf.DeepseekV3Config(**{k: getattr(m, k) for k in keys}, rope_parameters=rope, attention_dropout=0.0,
                               use_cache=False, pad_token_id=None, attn_implementation="eager",
                               experts_implementation="eager")


def record_routing(model, m: DeepseekV3Config) -> dict:
    """{MoE layer: (top-k indices, scaled weights)} as each layer's route_tokens_to_experts returns them, filled in
    by the forward, unchanged."""
    gates = {}
    for layer in moe_layers(m):
        _record_routing(model.model.layers[layer].mlp, layer, gates)
    return gates


def _record_routing(moe, layer: int, gates: dict) -> None:
    """Keep what route_tokens_to_experts returns (the top-k indices and scaled weights), unchanged."""
    original = moe.route_tokens_to_experts

    def routed(router_logits):
        indices, weights = original(router_logits)
        gates[layer] = (indices.detach().clone(), weights.detach().clone())
        return indices, weights

    moe.route_tokens_to_experts = routed


# --- float64 mode: the five places HF computes in float32 whatever the model's dtype ---------------------------------

@contextmanager
def float64_mode(hf, on: bool = True) -> Iterator[dict]:
    """Inside: HF's RMSNorm, router and eager attention compute in float64 (when `on`); yields {what: how} for
    meta.json ({} when off). They are class and module attributes, so the originals are put back when the block
    ends, however it ends: the next cell of a worker gets HF's own code (tests/test_worker_state.py)."""
    if not on:
        yield {}
        return
    with attribute_restored(hf.DeepseekV3RMSNorm, "forward"), attribute_restored(hf.DeepseekV3TopkRouter, "forward"), \
            attribute_restored(hf, "eager_attention_forward"):
        yield _replace_float32_islands(hf)


def _replace_float32_islands(hf) -> dict:
    def rms_norm(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float64)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def router(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.config.hidden_size)
        return F.linear(hidden_states.type(torch.float64), self.weight.type(torch.float64))

    def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = hf.repeat_kv(key, module.num_key_value_groups)
        value_states = hf.repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float64).to(query.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return attn_output, attn_weights

    hf.DeepseekV3RMSNorm.forward = rms_norm
    hf.DeepseekV3TopkRouter.forward = router
    hf.eager_attention_forward = eager_attention
    return {
        "DeepseekV3RMSNorm.forward": "normalises in float64 (HF: float32)",
        "DeepseekV3TopkRouter.forward": "router GEMM in float64 (HF: float32)",
        "DeepseekV3RotaryEmbedding": "YaRN inverse frequencies and cos/sin tables in float64 (HF: float32)",
        "eager_attention_forward": "softmax in float64 (HF: float32)",
        "loss": "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 first)",
    }


def yarn_inv_freq(config, dtype=torch.float64) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters (5.3.0), the same formula, in `dtype`."""
    rp = config.rope_parameters
    base, dim, factor = rp["rope_theta"], config.qk_rope_head_dim, rp["factor"]
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rp.get("attention_factor") or (
        float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)) if mscale and mscale_all_dim
        else get_mscale(factor))
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
    original = rp["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def _rotary_in_float64(rotary, config) -> None:
    inv_freq, rotary.attention_scaling = yarn_inv_freq(config)
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)

    def forward(x, position_ids):
        inv = rotary.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = forward
