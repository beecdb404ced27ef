"""The float64 mode HF transformers models share: the same formulas as HF's float32 islands (RMSNorm, the router:
its GEMM, softmax or sigmoid; the eager attention's softmax, the RoPE tables: default or YaRN), in float64. The hf
room (``harness.runners.torch.hf_families``) names which classes of a family's modeling module get which
(``islands``); nothing else changes, and HF's own code is put back when the cell ends
(``harness.run.cell_state.attribute_restored``), so a worker's next cell runs it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F

from harness.run.cell_state import attribute_restored


def rms_norm(self, hidden_states):
    """HF's RMSNorm (DeepseekV3RMSNorm, Glm4MoeRMSNorm, ...) with the variance in float64 (HF: float32)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float64)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def zero_centred_rms_norm(self, x):
    """HF's zero-centred RMSNorm (Qwen3_5MoeRMSNorm: ``output * (1.0 + weight)``) in float64 (HF: float32)."""
    output = x.to(torch.float64)
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
    return (output * (1.0 + self.weight.to(torch.float64))).type_as(x)


def router_gemm(self, hidden_states):
    """A sigmoid router's gating GEMM (DeepseekV3TopkRouter, Glm4MoeTopkRouter) in float64 (HF: float32)."""
    hidden_states = hidden_states.view(-1, self.config.hidden_size)
    return F.linear(hidden_states.type(torch.float64), self.weight.type(torch.float64))


def grouped_sigmoid_router(self, hidden_states):
    """A grouped sigmoid router's forward in transformers 5.23.0 (DeepseekV32TopkRouter; DeepSeek-V3's, GLM-4.5's and
    GLM-5's there too) with its GEMM and sigmoid in float64 (HF: float32); the routing after them is ``grouped_topk``.
    (5.3.0's routers compute the logits only: ``router_gemm``.)"""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float64), self.weight.type(torch.float64))
    topk_weights, topk_indices = grouped_topk(self, router_logits.sigmoid())
    return router_logits, topk_weights, topk_indices


def grouped_topk(router, scores):
    """(scaled top-k weights, indices) from a grouped sigmoid router's scores, HF 5.23.0's steps: the routing bias
    added for the choice only, the best ``topk_group`` groups by their two best scores, top-k among them (the others
    at -inf), the chosen scores normalised (+1e-20) and scaled."""
    choice = scores + router.e_score_correction_bias
    experts, groups = router.num_experts, router.num_group
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if router.norm_topk_prob:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return topk_weights * router.routed_scaling_factor, topk_indices


def softmax_router(self, hidden_states):
    """A softmax router's forward (Qwen2MoeTopKRouter, Qwen3MoeTopKRouter, Qwen3_5MoeTopKRouter: transformers 5.3.0)
    with the softmax in the model's dtype (HF: float32): in a float64 run, float64. Qwen3.5's router has no
    norm_topk_prob: it renormalises always, as here."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_logits = torch.nn.functional.softmax(router_logits, dtype=hidden_states.dtype, dim=-1)
    router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


def sigmoid_router(self, hidden_states, e_score_correction_bias):
    """A sigmoid router with a routing bias (``MiniMaxM2TopKRouter.forward``) with the sigmoid in float64 (HF:
    ``sigmoid(router_logits.float())``): the same steps, the gating GEMM in the weight's dtype (float64 here)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
    routing_weights = torch.sigmoid(router_logits.to(torch.float64))
    scores_for_choice = routing_weights + e_score_correction_bias
    _, top_k_index = torch.topk(scores_for_choice, self.top_k, dim=-1, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    return router_logits, top_k_weights, top_k_index


def eager_attention(hf):
    """The modeling module's eager_attention_forward with its softmax in float64 (HF: float32)."""
    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = hf.repeat_kv(key, module.num_key_value_groups)
        value_states = hf.repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float64).to(query.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return attn_output, attn_weights
    return forward


def default_rope(rotary, config) -> None:
    """A rotary module of rope_type "default" (partial_rotary_factor honoured) with its inverse frequencies and
    cos/sin tables in float64: transformers' compute_default_rope_parameters and forward (5.3.0), the same formula."""
    rp = config.rope_parameters
    base, factor = rp["rope_theta"], rp.get("partial_rotary_factor", 1.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * factor)
    rotary.inv_freq = (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))).to(
        rotary.inv_freq.device)
    rotary.attention_scaling = 1.0
    rotary.forward = _float64_tables(rotary)


def yarn_rope(rotary, config) -> None:
    """A rotary module of rope_type "yarn" (DeepSeek-V3's) with its inverse frequencies and cos/sin tables in
    float64."""
    inv_freq, rotary.attention_scaling = yarn_inv_freq(config)
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
    rotary.forward = _float64_tables(rotary)


def _float64_tables(rotary):
    """The rotary module's forward (transformers 5.3.0) with its cos/sin tables computed in float64."""
    def forward(x, position_ids):
        position_ids = text_positions(position_ids)
        inv = rotary.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)
    return forward


def text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] positions. Qwen3.5's M-RoPE passes three rows ([3, batch, tokens]: text, height, width), equal
    for text tokens, where its interleaved sections change nothing: one row then; unequal rows are refused (an image's
    positions, which the harness does not feed)."""
    if position_ids.dim() == 2:
        return position_ids
    if not bool((position_ids == position_ids[0]).all()):
        raise ValueError("M-RoPE position rows differ (not text tokens): the float64 tables take text positions only")
    return position_ids[0]


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


@contextmanager
def islands(entries: list[tuple[object, str, object, str, str]], on: bool = True) -> Iterator[dict]:
    """Inside: for each (owner, attribute, function, label, why) of `entries`, ``owner.attribute = function``; yields
    {label: why} for meta.json ({} when not `on`). The originals come back when the block ends, however it ends."""
    if not on:
        yield {}
        return
    with ExitStack() as stack:
        for owner, attribute, function, _, _ in entries:
            stack.enter_context(attribute_restored(owner, attribute))
            setattr(owner, attribute, function)
        yield {label: why for _, _, _, label, why in entries}
