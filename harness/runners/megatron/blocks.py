"""The modules Megatron-Core's local spec lacks for some families, written once for every family that needs them
(``harness.runners.megatron.families`` says which family gets which, from its architecture or its megatron.toml):

- ``MLADotProductAttention`` (attention kind "mla"): the local ``DotProductAttention`` as ``MLASelfAttention`` calls
  it. The local class refuses the ``k_channels``/``v_channels`` that ``MLASelfAttention`` passes; the subclass accepts
  them and sizes its output view with ``v_channels`` (MLA's v head dim differs from the qk head dim); the scores and
  context are the parent's own code, with MLA's softmax scale.
- ``FullDimQNorm`` / ``FullDimKNorm`` (q/k norm "all_heads", MiniMax-M2): one RMSNorm over all heads of a token,
  which Megatron-Core 0.16.1 cannot express. transformers 5.3.0 ``MiniMaxM2Attention`` builds ``q_norm =
  MiniMaxM2RMSNorm(num_attention_heads * head_dim)`` and applies it to ``q_proj``'s output before the head split;
  megatron-core 0.16.1's ``SelfAttention.__init__`` (``megatron/core/transformer/attention.py``, lines 1280-1298 of
  the installed 0.16.1) sizes ``q_layernorm`` / ``k_layernorm`` to one head and ``qk_layernorm`` only switches that
  per-head norm on. Megatron Bridge provides the module in its TE spec only:
  ``src/megatron/bridge/models/minimax_m2/minimax_m2_provider.py`` @ 46bab91db74f1a2a211ef505ec76d0428b3da984
  (``_FullDimRMSNorm``, built by the factories ``FullDimQNorm`` / ``FullDimKNorm`` that ``minimax_m2_layer_spec``
  puts on ``get_gpt_layer_with_transformer_engine_spec``; wired by ``MiniMaxM2Bridge.provider_bridge``,
  ``minimax_m2_bridge.py`` @ 39b79eb785325f8e4e5dc2400ff3924824e3121c). Written here, not copied: the input
  ``[s, b, heads, head_dim]`` flattened to ``[s, b, heads x head_dim]``, the sum of squares in float32 divided by
  that width, ``rsqrt(variance + eps)``, ``weight * x.to(dtype)``, reshaped back. At tensor-parallel size 1 (the only
  size this runner builds) Bridge's all-reduce of the sum of squares is over one rank and changes nothing; it is not
  written. One departure, for the float64 truth only: the statistic is computed in float32 *or the input's dtype
  when wider* (Bridge: float32 always), so a float64 run stays float64. The norm is a child (``norm``) of the
  ``q_layernorm`` / ``k_layernorm`` module, which only reshapes: its output is ``[s, b, heads x head_dim]``, the
  canonical ``q_norm`` output (the parameter is ``q_layernorm.norm.weight``; Bridge names it ``q_layernorm.weight``,
  an on-disk name this harness never reads).
- ``routing_record_router`` (a family's megatron.toml ``routing_record = true``): Megatron-Core's ``TopKRouter`` with
  an identity child (``routing_record``) it hands its (probs, routing_map) to, which returns the probabilities
  widened to float32 for the capture hook; the router's own outputs, and so the model's computation, are unchanged.
"""

from __future__ import annotations

from functools import cache, partial

import torch

from harness.run.protocol import Unsupported

try:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
except Exception:  # noqa: BLE001 - the runner reports a missing or broken Megatron-Core before it builds anything
    DotProductAttention = object


class MLADotProductAttention(DotProductAttention):
    """The local ``DotProductAttention`` as MLA calls it: ``k_channels`` (qk head dim incl. RoPE) and ``v_channels``
    accepted. Its computation reads the head dims from the query/key/value tensors themselves (``reshape(..., -1)``);
    the only size taken from the config is the output view ``hidden_size_per_partition`` (kv_channels * heads),
    which must be ``v_channels * heads`` here. The softmax scale is MLA's explicit one (YaRN mscale^2 / sqrt(qk))."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.k_channels, self.v_channels = k_channels, v_channels


class AllHeadsRMSNorm(torch.nn.Module):
    """One RMSNorm over the last dim of ``[s, b, heads x head_dim]`` (every head of a token together): the statistic in
    float32 (or the input's dtype where wider: float64 runs), ``sum(x^2) / width`` as Megatron Bridge's
    ``_FullDimRMSNorm`` takes it, ``rsqrt(variance + eps)``, then ``weight * x.to(dtype)``."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.width, self.eps = width, eps
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        wide = x.to(torch.promote_types(dtype, torch.float32))
        variance = wide.pow(2).sum(-1, keepdim=True) / self.width
        return self.weight * (wide * torch.rsqrt(variance + self.eps)).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}"


class FullDimNorm(torch.nn.Module):
    """``q_layernorm`` / ``k_layernorm`` as SelfAttention calls it, on ``[s, b, heads, head_dim]``: flattened to one row
    per token, normalised by ``norm`` (``AllHeadsRMSNorm``, whose output is the canonical q_norm / k_norm), reshaped
    back."""

    def __init__(self, heads: int, head_dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.norm = AllHeadsRMSNorm(heads * head_dim, eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)


def _full_dim(heads: int, head_dim: int, config, eps: float) -> FullDimNorm:
    if config.tensor_model_parallel_size != 1:  # Bridge all-reduces the sum of squares over TP; not written here
        raise Unsupported("MiniMax-M2's all-heads q/k norm is written for tensor-parallel size 1 "
                          f"(got {config.tensor_model_parallel_size})")
    return FullDimNorm(heads, head_dim, eps, config.params_dtype)


class FullDimQNorm:
    """The q_layernorm spec entry: SelfAttention calls it as ``(hidden_size=head_dim, config=..., eps=...)``; it
    builds the norm over all query heads (``num_attention_heads x head_dim``). A class, as Bridge's: Megatron's
    ``build_module`` returns a plain function unbuilt."""

    def __new__(cls, hidden_size: int, config, eps: float = 1e-6) -> FullDimNorm:
        return _full_dim(config.num_attention_heads, hidden_size, config, eps)


class FullDimKNorm:
    """The k_layernorm spec entry: the norm over all key heads (``num_query_groups x head_dim``)."""

    def __new__(cls, hidden_size: int, config, eps: float = 1e-6) -> FullDimNorm:
        return _full_dim(config.num_query_groups or config.num_attention_heads, hidden_size, config, eps)


def moe_submodules(mlp):
    """A layer spec's ``MoESubmodules``: a ModuleSpec's ``submodules`` (megatron-core 0.16) or the ``submodules``
    keyword of the ``functools.partial(MoELayer, ...)`` that 0.19's moe_module_specs builds; None in a dense layer."""
    submodules = getattr(mlp, "submodules", None)
    if submodules is None and isinstance(mlp, partial):
        submodules = mlp.keywords.get("submodules")
    return submodules if hasattr(submodules, "router") else None


class RoutingRecord(torch.nn.Module):
    """Identity for the capture hook: (probs widened to at least float32, routing_map). Its output goes nowhere."""

    def forward(self, probs: torch.Tensor, routing_map: torch.Tensor):
        return probs.detach().to(torch.promote_types(probs.dtype, torch.float32)), routing_map


@cache
def routing_record_router():
    """megatron.core's TopKRouter with a ``routing_record`` child (one class, made when first asked: Megatron-Core
    is imported by runners only)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class RoutingRecordRouter(TopKRouter):
        """TopKRouter, its outputs handed to ``routing_record`` as well (for the capture hook) and returned as they
        are."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.routing_record = RoutingRecord()

        def forward(self, *args, **kwargs):
            probs, routing_map = super().forward(*args, **kwargs)
            self.routing_record(probs, routing_map)
            return probs, routing_map

    return RoutingRecordRouter
