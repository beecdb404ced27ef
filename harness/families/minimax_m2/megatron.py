"""MiniMax-M2 on Megatron-Core: the HF config translated to ``TransformerConfig`` as Megatron Bridge translates it, and
the full-dimension q/k RMSNorm, which Megatron-Core cannot express, in each layer's local spec.
``harness.runners.megatron.model`` builds, loads and runs the ``GPTModel``.

**The q/k norm.** MiniMax-M2 normalises q (and k) with one RMSNorm over all heads of a token (transformers 5.3.0
``MiniMaxM2Attention``: ``q_norm = MiniMaxM2RMSNorm(num_attention_heads * head_dim)`` applied to ``q_proj``'s output
before the head split). Megatron-Core 0.16.1 has no setting for it: ``SelfAttention.__init__``
(``megatron/core/transformer/attention.py``, lines 1280-1298 of the installed 0.16.1) builds
``q_layernorm`` / ``k_layernorm`` with ``hidden_size=self.hidden_size_per_attention_head``, one head's width, and
``qk_layernorm`` only switches that per-head norm on. Megatron Bridge provides the module for this family, in its TE
spec only: ``src/megatron/bridge/models/minimax_m2/minimax_m2_provider.py`` @
46bab91db74f1a2a211ef505ec76d0428b3da984 (``_FullDimRMSNorm``, built by the factories ``FullDimQNorm`` /
``FullDimKNorm`` that ``minimax_m2_layer_spec`` puts on ``get_gpt_layer_with_transformer_engine_spec``; wired by
``MiniMaxM2Bridge.provider_bridge``, ``minimax_m2_bridge.py`` @ 39b79eb785325f8e4e5dc2400ff3924824e3121c). This
builder puts the same computation into the local spec (``layer_spec``), written here, not copied: the input
``[s, b, heads, head_dim]`` flattened to ``[s, b, heads x head_dim]``, the sum of squares in float32 divided by that
width, ``rsqrt(variance + eps)``, ``weight * x.to(dtype)``, reshaped back. At tensor-parallel size 1 (the only size
this runner builds) Bridge's all-reduce of the sum of squares is over one rank and changes nothing; it is not
written. One departure, for the float64 truth only: the statistic is computed in float32 *or the input's dtype when
wider* (Bridge: float32 always), so a float64 run stays float64 as every other module of the model does; bf16 and
float32 runs compute exactly Bridge's formula. ``tests/test_minimax_m2.py`` shows the module gives transformers'
``q_norm`` / ``k_norm`` bits on the same input (float32 and bf16) and is named in meta.json ``adapters``.

The norm is a child (``norm``) of the ``q_layernorm`` / ``k_layernorm`` module, which only reshapes: its output is
``[s, b, heads x head_dim]``, the canonical ``q_norm`` output as transformers computes it, so the capture and the
re-feed need no reshape of their own (the parameter is ``q_layernorm.norm.weight``; Bridge names it
``q_layernorm.weight``, an on-disk name this harness never reads).

Where each other setting comes from (NVIDIA-NeMo/Megatron-Bridge, read in the mirror at 067f987d):
- ``MiniMaxM2Bridge.provider_bridge`` (above): RMSNorm, gated linear unit, ``add_bias_linear`` and ``add_qkv_bias``
  False, hidden dropout 0, ``rotary_percent = rotary_dim / head_dim``, ``qk_layernorm`` True with the full-dimension
  norm, sigmoid scores, expert bias on, ``moe_router_pre_softmax`` False, aux loss ``router_aux_loss_coef``, grouped
  GEMM, alltoall dispatcher, permute fusion; ``moe_router_dtype`` and ``moe_router_topk_scaling_factor`` left unset
  (None: the gating GEMM in the model dtype, no scaling), ``moe_router_bias_update_rate`` left at its default 1e-3.
- ``src/megatron/bridge/models/conversion/model_bridge.py`` @ a95a3daf66744fbe8fd4d5d6218c48aeffefd21f,
  ``CONFIG_MAPPING`` (lines 456-499): num_key_value_heads -> num_query_groups, head_dim -> kv_channels,
  intermediate_size -> ffn_hidden_size (MiniMax-M2 has no moe_intermediate_size, so ``moe_ffn_hidden_size`` is
  Megatron's default, ``ffn_hidden_size``), num_local_experts -> num_moe_experts, num_experts_per_tok ->
  moe_router_topk, rope_theta -> rotary_base, rms_norm_eps -> layernorm_epsilon.
Where the harness departs from Bridge, for a CPU run that compares bits with HF (each in ``knobs``): no auxiliary
loss (HF computes none without output_router_logits), the expert bias update rate 0 (one step; the bias is not
trained in HF), SequentialMLP (Bridge: grouped GEMM, a CUDA kernel), the allgather dispatcher (Bridge: alltoall, for
expert parallelism), no fusions (CUDA kernels), no MTP (HF has none), ``softmax_scale`` HF's ``head_dim ** -0.5``.
"""

from __future__ import annotations

import torch

from harness.families import FamilyConfig as MiniMaxM2Config
from harness.run.protocol import Unsupported

IMPLEMENTATION = ("megatron.core.models.gpt.GPTModel, local spec (no TE): SelfAttention (linear_qkv, local "
                  "DotProductAttention, q_layernorm / k_layernorm = FullDimQNorm / FullDimKNorm: one RMSNorm over "
                  "all heads, Megatron Bridge's MiniMax-M2 module written for the local spec), MoELayer(TopKRouter, "
                  "SequentialMLP), WrappedTorchNorm RMSNorm, RotaryEmbedding (rotary_percent), "
                  "vocab_parallel_cross_entropy")

FULL_DIM_QK_NORM = "FullDimQKNorm"
ADAPTERS = {
    FULL_DIM_QK_NORM: "a module the family needs that Megatron-Core's local spec lacks; Megatron Bridge provides it "
    "in its TE spec (src/megatron/bridge/models/minimax_m2/minimax_m2_provider.py @ "
    "46bab91db74f1a2a211ef505ec76d0428b3da984: _FullDimRMSNorm via FullDimQNorm / FullDimKNorm). "
    "harness.families.minimax_m2.megatron.FullDimQNorm / FullDimKNorm, in every layer's local spec as q_layernorm / "
    "k_layernorm: one RMSNorm over all heads of a token (float32 sum of squares / (heads x head_dim), rsqrt(+eps), "
    "weight * x.to(dtype); float64 in a float64 run), as Bridge's and as transformers' MiniMaxM2RMSNorm; "
    "megatron-core 0.16.1's own q_layernorm is sized to one head (transformer/attention.py, SelfAttention)",
}


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
        raise Unsupported("megatron_model: MiniMax-M2's all-heads q/k norm is written for tensor-parallel size 1 "
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


def install_adapters(skip=(), te_installed: bool = False) -> list[str]:
    """The family's module in the layer spec (``layer_spec``), named for meta.json unless `skip` leaves it out (the
    tests that show it is needed); nothing is patched."""
    return [] if FULL_DIM_QK_NORM in skip else [FULL_DIM_QK_NORM]


def layer_spec(spec, skip=()) -> None:
    """The full-dimension q/k norm as one layer's q_layernorm / k_layernorm (in place); skipped: the local spec's own
    per-head norm stays (and the weights do not fit it)."""
    if FULL_DIM_QK_NORM in skip:
        return
    attention = spec.submodules.self_attention.submodules
    attention.q_layernorm, attention.k_layernorm = FullDimQNorm, FullDimKNorm


def gpt_model_kwargs(model: MiniMaxM2Config) -> dict:
    """GPTModel's own RoPE arguments (not TransformerConfig fields in megatron-core 0.16): partial rotary, as Bridge
    sets it (rotary_percent = rotary_dim / head_dim)."""
    return {"rotary_percent": float(model.rotary_dim / model.head_dim), "rotary_base": float(model.rope_theta)}


def translate_config(model: MiniMaxM2Config, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The typed config -> (``TransformerConfig``, knobs: every setting chosen and why); `expert_parallel`: the
    experts split over that many ranks."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers, experts, topk = model.num_hidden_layers, model.num_local_experts, model.num_experts_per_tok
    if topk < 2:
        raise Unsupported("megatron_model: Megatron's sigmoid router leaves a single top-1 score unnormalised "
                          "(moe_utils.topk_routing_with_score_function: probs = scores when topk == 1); MiniMax-M2 "
                          "divides it by itself (num_experts_per_tok 1)")
    router_dtype = "fp64" if dtype == torch.float64 else None
    knobs = {
        "spec": "get_gpt_decoder_block_spec(use_transformer_engine=False, normalization='RMSNorm') (every layer MoE: "
                "moe_layer_freq 1), q_layernorm / k_layernorm replaced by FullDimQNorm / FullDimKNorm (the family's "
                "module, see adapters; Bridge: minimax_m2_layer_spec on the TE spec), WrappedTorchNorm for the other "
                "norms",
        "num_query_groups / kv_channels": f"{model.num_key_value_heads} / {model.head_dim} (num_key_value_heads, "
                                          "head_dim: Bridge's CONFIG_MAPPING)",
        "add_qkv_bias / add_bias_linear": "False / False (Bridge)",
        "qk_layernorm": "True with the full-dimension norm (Bridge: qk_layernorm True, transformer_layer_spec "
                        "minimax_m2_layer_spec)",
        "rotary_percent / rotary_base": f"{model.rotary_dim / model.head_dim} / {float(model.rope_theta)} "
                                        f"(rotary_dim "
                                        f"{model.rotary_dim} / head_dim {model.head_dim}, as Bridge computes it; "
                                        "rope_theta): GPTModel arguments",
        "ffn_hidden_size / moe_ffn_hidden_size": f"{model.intermediate_size} / {model.intermediate_size} "
                                                 "(intermediate_size, the expert width; Bridge sets no "
                                                 "moe_ffn_hidden_size, Megatron defaults it to ffn_hidden_size)",
        "softmax_scale": "head_dim ** -0.5, HF's scaling (Megatron's default 1 / math.sqrt(head_dim) is the same "
                         "float32; in float64 it is one ulp away at head_dim 32 and 128)",
        "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert (Bridge: True, a CUDA grouped GEMM)",
        "moe_token_dispatcher_type": "allgather" + (
            f": expert_model_parallel_size {expert_parallel}" if expert_parallel > 1 else " (one expert-parallel "
            "rank; Bridge: alltoall)"),
        "moe_router_score_function": "sigmoid, expert bias on, pre_softmax False, no topk scaling (Bridge)",
        "moe_router_dtype": ("fp64: a float64 case keeps the gating GEMM in float64" if router_dtype else
                             "None (Bridge leaves it unset): the gating GEMM in the model dtype, as HF's "
                             "F.linear(x.to(weight.dtype), weight)") +
                            "; Megatron computes sigmoid(logits.float()) in fp32 and casts the scores back to the "
                            "logits' dtype (.type_as), so bf16 scores are bf16 (HF keeps them fp32)",
        "moe_router_bias_update_rate": "0: the expert bias does not move (Bridge keeps Megatron's default 1e-3; HF "
                                       "never updates it)",
        "moe_router_load_balancing_type": "none, moe_aux_loss_coeff 0: no auxiliary loss in the gradients (Bridge: "
                                          "aux_loss, router_aux_loss_coef; HF adds none without "
                                          "output_router_logits)",
        "mtp_num_layers": "None: no multi-token-prediction modules (MiniMax-M2 has 3; Bridge maps none; HF has none)",
        "bias_activation_fusion": "True: SwiGLU through weighted_bias_swiglu_impl (hand-written backward), eager "
                                  "(TORCHDYNAMO_DISABLE=1)",
        "attention_softmax_in_fp32": "True: FusedScaleMaskSoftmax's unfused path upcasts bf16 scores "
                                     "(no-op in fp32/64)",
        "masked_softmax_fusion": "False: the torch softmax path (the fused kernels are CUDA extensions)",
        "apply_rope_fusion": "False: unfused RoPE (_apply_rotary_pos_emb_bshd on the first rotary_percent dims)",
        "cross_entropy_loss_fusion": "False: tensor_parallel.vocab_parallel_cross_entropy (fp32 logits)",
        "hidden_dropout / attention_dropout": "0.0",
        "attention_backend": "local: the local spec's DotProductAttention",
        "share_embeddings_and_output_weights": "False (tie_word_embeddings)",
        "params_dtype": f"{dtype}: GPTModel cast with .to(dtype) as Float16Module does for bf16 (norm weights "
                        "included); the router's expert_bias stays float32 (Megatron keeps it so)",
    }
    config = TransformerConfig(
        num_layers=layers, hidden_size=model.hidden_size, ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim, add_qkv_bias=False, qk_layernorm=True, softmax_scale=model.head_dim ** -0.5,
        normalization="RMSNorm", layernorm_epsilon=float(model.rms_norm_eps), attention_backend=AttnBackend.local,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_ffn_hidden_size=model.intermediate_size, moe_router_topk=topk,
        moe_layer_freq=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None, moe_router_bias_update_rate=0.0,
        moe_router_dtype=router_dtype, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    return config, knobs
