"""The float64 mode HF transformers models share: the same formulas as HF's float32 islands (RMSNorm, the router GEMM,
the eager attention's softmax, the RoPE tables), in float64. A family's HF builder (``harness/families/<family>/
hf.py``) names which classes of its modeling module get which (``islands``); nothing else changes, and HF's own code
is put back when the cell ends (``harness.run.cell_state.attribute_restored``), so a worker's next cell runs it."""

from __future__ import annotations

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


def router_gemm(self, hidden_states):
    """A sigmoid router's gating GEMM (DeepseekV3TopkRouter, Glm4MoeTopkRouter) in float64 (HF: float32)."""
    hidden_states = hidden_states.view(-1, self.config.hidden_size)
    return F.linear(hidden_states.type(torch.float64), self.weight.type(torch.float64))


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

    def forward(x, position_ids):
        inv = rotary.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = forward


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
