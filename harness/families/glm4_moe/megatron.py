"""GLM-4.5 MoE on Megatron-Core: the HF config translated to ``TransformerConfig`` as Megatron Bridge translates it.
``harness.runners.megatron.model`` builds, loads and runs the ``GPTModel`` (local spec: plain ``SelfAttention`` with
the local ``DotProductAttention``; no adapter of the family's own is needed).

Where each setting comes from (NVIDIA-NeMo/Megatron-Bridge, read in the mirror at 067f987d):
- ``src/megatron/bridge/models/glm/glm45_bridge.py`` @ 282e0ba87dee0b82334f06ce2acd46f21256f30b,
  ``GLM45Bridge.provider_bridge``: ``get_gpt_decoder_block_spec`` (dense first layers through ``moe_layer_freq = [0] *
  first_k_dense_replace + [1] * rest``), RMSNorm, gated linear unit, ``add_bias_linear`` False, untied embeddings,
  ``moe_router_pre_softmax`` False, sigmoid scores, expert bias on, ``moe_router_dtype`` fp32,
  ``moe_router_bias_update_rate`` 0, ``moe_shared_expert_intermediate_size`` = moe_intermediate_size, hidden dropout 0.
- ``src/megatron/bridge/models/conversion/model_bridge.py`` @ a95a3daf66744fbe8fd4d5d6218c48aeffefd21f,
  ``CONFIG_MAPPING`` (lines 456-499): num_key_value_heads -> num_query_groups, head_dim -> kv_channels,
  attention_bias -> add_qkv_bias, use_qk_norm -> qk_layernorm, rope_theta -> rotary_base, partial_rotary_factor ->
  rotary_percent, routed_scaling_factor -> moe_router_topk_scaling_factor, n_routed_experts -> num_moe_experts,
  num_experts_per_tok -> moe_router_topk, moe_intermediate_size -> moe_ffn_hidden_size, rms_norm_eps ->
  layernorm_epsilon.
- ``src/megatron/bridge/models/glm/glm45_provider.py`` @ 89f594a765a4af366c8ad7e50c61411b4995e78b (the dataclass
  providers before the bridge): the same values (add_qkv_bias True, rotary_percent 0.5, rotary_base 1e6).
Where the harness departs from Bridge, for a CPU run that compares bits with HF (each in ``knobs``): no auxiliary loss
(Bridge: seq_aux_loss 1e-3; HF computes none), SequentialMLP (Bridge: grouped GEMM, a CUDA kernel), the allgather
dispatcher (Bridge: alltoall, for expert parallelism), no fusions (CUDA kernels), no MTP layer (HF has none),
``softmax_scale`` HF's ``head_dim ** -0.5`` (Megatron's default ``1 / math.sqrt(head_dim)`` is the same float32 and
one double ulp away at head_dim 32 and 128: it would show only in float64).
"""

from __future__ import annotations

import torch

from harness.families import FamilyConfig as Glm4MoeConfig
from harness.run.protocol import Unsupported

IMPLEMENTATION = ("megatron.core.models.gpt.GPTModel, local spec (no TE): SelfAttention (linear_qkv, local "
                  "DotProductAttention), MoELayer(TopKRouter, SequentialMLP, SharedExpertMLP), WrappedTorchNorm "
                  "RMSNorm, RotaryEmbedding (rotary_percent), vocab_parallel_cross_entropy")
ADAPTERS = {}  # none of its own: the runner's CPU shims only


def install_adapters(skip=(), te_installed: bool = False) -> list[str]:
    """GLM-4.5 needs no adapter of its own on the local spec."""
    return []


def layer_spec(spec, skip=()) -> None:
    """The local spec's modules as they are (SelfAttention with the local DotProductAttention, WrappedTorchNorm for
    q_layernorm / k_layernorm when use_qk_norm)."""


def gpt_model_kwargs(model: Glm4MoeConfig) -> dict:
    """GPTModel's own RoPE arguments (not TransformerConfig fields in megatron-core 0.16): partial rotary."""
    return {"rotary_percent": float(model.partial_rotary_factor), "rotary_base": float(model.rope_theta)}


def translate_config(model: Glm4MoeConfig, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The typed config (HF ``Glm4MoeConfig`` keys) -> (``TransformerConfig``, knobs: every setting chosen and why);
    `expert_parallel`: the experts split over that many ranks."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers, experts, topk = model.num_hidden_layers, model.n_routed_experts, model.num_experts_per_tok
    dense = int(model.first_k_dense_replace)
    if not model.norm_topk_prob and topk > 1:
        raise Unsupported("megatron_model: Megatron's sigmoid router always normalises the top-k probabilities "
                          "(norm_topk_prob false)")
    router_dtype = "fp64" if dtype == torch.float64 else "fp32"
    knobs = {
        "spec": "get_gpt_decoder_block_spec(use_transformer_engine=False, normalization='RMSNorm'), as Bridge's "
                "GLM45Bridge (use_transformer_engine=HAVE_TE): local modules, WrappedTorchNorm (torch.nn.RMSNorm) for "
                "every norm incl. q_layernorm / k_layernorm and the final one",
        "moe_layer_freq": f"{dense} dense layer(s) then MoE (first_k_dense_replace; Bridge's list)",
        "num_query_groups / kv_channels": f"{model.num_key_value_heads} / {model.head_dim} (num_key_value_heads, "
                                          "head_dim: Bridge's CONFIG_MAPPING)",
        "add_qkv_bias": f"{model.attention_bias} (attention_bias); add_bias_linear False (no other bias)",
        "qk_layernorm": f"{model.use_qk_norm} (use_qk_norm)",
        "rotary_percent / rotary_base": f"{model.partial_rotary_factor} / {float(model.rope_theta)} "
                                        "(partial_rotary_factor, rope_theta): GPTModel arguments",
        "softmax_scale": "head_dim ** -0.5, HF's scaling (Megatron's default 1 / math.sqrt(head_dim) is the same "
                         "float32; in float64 it is one ulp away at head_dim 32 and 128)",
        "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert (Bridge: True, a CUDA grouped GEMM)",
        "moe_token_dispatcher_type": "allgather" + (
            f": expert_model_parallel_size {expert_parallel}" if expert_parallel > 1 else " (one expert-parallel "
            "rank; Bridge: alltoall)"),
        "moe_router_score_function": "sigmoid, expert bias on, pre_softmax False, topk scaling "
                                     f"{float(model.routed_scaling_factor)} (Bridge)",
        "moe_router_dtype": f"{router_dtype}: the gating GEMM in {router_dtype} (Bridge: fp32, HF's float32 router "
                            "GEMM; float64 cases keep float64). Megatron computes sigmoid(logits.float()) in fp32 "
                            "whatever this says",
        "moe_router_bias_update_rate": "0 (Bridge): the expert bias does not move",
        "moe_router_load_balancing_type": "none, moe_aux_loss_coeff 0: no auxiliary loss in the gradients (Bridge: "
                                          "seq_aux_loss 1e-3; HF has none)",
        "mtp_num_layers": "None: no multi-token-prediction layer (Bridge: num_nextn_predict_layers; HF has none)",
        "bias_activation_fusion": "True: SwiGLU through bias_swiglu_impl / weighted_bias_swiglu_impl (hand-written "
                                  "backward), eager (TORCHDYNAMO_DISABLE=1), as Bridge",
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
        kv_channels=model.head_dim, add_qkv_bias=model.attention_bias, qk_layernorm=model.use_qk_norm,
        softmax_scale=model.head_dim ** -0.5,
        normalization="RMSNorm", layernorm_epsilon=float(model.rms_norm_eps), attention_backend=AttnBackend.local,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_ffn_hidden_size=model.moe_intermediate_size, moe_router_topk=topk,
        moe_layer_freq=[0] * dense + [1] * (layers - dense),
        moe_shared_expert_intermediate_size=model.moe_intermediate_size * model.n_shared_experts,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=float(model.routed_scaling_factor), moe_router_bias_update_rate=0.0,
        moe_router_dtype=router_dtype, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    return config, knobs
