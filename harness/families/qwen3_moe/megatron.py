"""Qwen3-MoE on Megatron-Core: the HF config translated to ``TransformerConfig`` as Megatron Bridge translates it.
``harness.runners.megatron.model`` builds, loads and runs the ``GPTModel`` (local spec: plain ``SelfAttention`` with
per-head ``q_layernorm`` / ``k_layernorm`` and the local ``DotProductAttention``; a softmax ``TopKRouter``).

Where each setting comes from (NVIDIA-NeMo/Megatron-Bridge, read in the mirror at 067f987d):
- ``src/megatron/bridge/models/qwen/qwen3_moe_bridge.py`` @ 07d0acf5c150eeb797ee4a8d4cb9b33e4bac9d69,
  ``Qwen3MoEBridge.provider_bridge``: RMSNorm, gated linear unit, ``add_bias_linear`` False, ``add_qkv_bias`` False,
  hidden dropout 0, ``qk_layernorm`` True, ``moe_router_pre_softmax = not norm_topk_prob`` (the fix of 2026-07-20:
  norm_topk_prob true, the real models' value, is top-k on the logits, then a softmax over those k), aux_loss 1e-3,
  grouped GEMM, alltoall dispatcher, permute fusion; no ``moe_router_dtype`` (None: the gating GEMM in the model's
  dtype, as HF's ``Qwen3MoeTopKRouter``), no expert bias, no top-k scaling, no shared expert; every layer MoE
  (``megatron_to_hf_config``: ``decoder_sparse_step = 1``).
- ``src/megatron/bridge/models/conversion/model_bridge.py`` @ a95a3daf66744fbe8fd4d5d6218c48aeffefd21f,
  ``CONFIG_MAPPING`` (lines 456-499): num_key_value_heads -> num_query_groups, head_dim -> kv_channels,
  attention_bias -> add_qkv_bias, rope_theta -> rotary_base, num_experts -> num_moe_experts, num_experts_per_tok ->
  moe_router_topk, moe_intermediate_size -> moe_ffn_hidden_size, rms_norm_eps -> layernorm_epsilon, intermediate_size
  -> ffn_hidden_size.
- ``src/megatron/bridge/models/qwen/qwen_provider.py`` @ 53f91f2283278a73b9d135b37f3f1af8727f2db3 (the dataclass
  providers before the bridge, ``Qwen3MoEModelProvider``): the same values (kv_channels 128, qk_layernorm, rotary_base
  1e6, moe_router_pre_softmax False, no moe_router_dtype).
Where the harness departs from Bridge, for a CPU run that compares bits with HF (each in ``knobs``): no auxiliary loss
(Bridge: aux_loss 1e-3; HF computes none without output_router_logits), SequentialMLP (Bridge: grouped GEMM, a CUDA
kernel), the allgather dispatcher (Bridge: alltoall, for expert parallelism), no fusions (CUDA kernels),
``softmax_scale`` HF's ``head_dim ** -0.5`` (Megatron's default ``1 / math.sqrt(head_dim)`` is the same float32 and
one double ulp away at head_dim 128: it would show only in float64), and ``moe_layer_freq`` from ``mlp_only_layers`` /
``decoder_sparse_step`` when a diagnostic case makes layers dense (the real models have none; Bridge maps neither).

Not bitwise by construction against HF (docs/model.md measures it): the router. HF's ``Qwen3MoeTopKRouter`` takes
the softmax over all experts in float32, its top-k, and divides by their sum; Megatron (``pre_softmax`` False) takes
the top-k of the logits and a float32 softmax over those k (then casts to the model dtype). Equal in exact arithmetic,
not in float32; Megatron-Core 0.16.1 has no setting that computes HF's order (``pre_softmax`` True is
norm_topk_prob false: no renormalisation).

The family's one module of its own: ``RoutingRecordRouter``, Megatron-Core's ``TopKRouter`` with an identity child
(``routing_record``) it hands its (probs, routing_map) to, which returns the probabilities widened to float32 for the
capture hook (exact: in a bf16 case Megatron's softmax router casts them to bf16, and the contract writes float32);
the router's own outputs, and so the model's computation, are the parent's, unchanged (``ADAPTERS``;
tests/test_qwen3_moe.py checks it).
"""

from __future__ import annotations

from functools import cache, partial

import torch

from harness.families import FamilyConfig as Qwen3MoeConfig
from harness.families import family_of

IMPLEMENTATION = ("megatron.core.models.gpt.GPTModel, local spec (no TE): SelfAttention (linear_qkv, q_layernorm / "
                  "k_layernorm per head, local DotProductAttention), MoELayer(TopKRouter softmax, SequentialMLP), "
                  "WrappedTorchNorm RMSNorm, RotaryEmbedding, vocab_parallel_cross_entropy")
ADAPTERS = {
    "routing_record": "each MoE layer's router is megatron.core's TopKRouter with one identity child "
                      "(routing_record) it passes its (probs, routing_map) to; the child returns the probabilities "
                      "widened to float32 (exact) for the capture hook, and the router returns its own outputs "
                      "unchanged (Megatron's softmax router holds bf16 probabilities in a bf16 model; the contract "
                      "writes float32)",
}


def install_adapters(skip=(), te_installed: bool = False) -> list[str]:
    """The routing record goes in with the layer spec (``layer_spec``); nothing to patch."""
    return [] if "routing_record" in skip else ["routing_record"]


def layer_spec(spec, skip=()) -> None:
    """The local spec's modules as they are (SelfAttention with the local DotProductAttention, WrappedTorchNorm for
    q_layernorm / k_layernorm), and in a MoE layer the router with its routing record."""
    submodules = moe_submodules(getattr(spec.submodules, "mlp", None))
    if "routing_record" not in skip and submodules is not None:
        submodules.router = routing_record_router()


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


def gpt_model_kwargs(model: Qwen3MoeConfig) -> dict:
    """GPTModel's own RoPE arguments (not TransformerConfig fields in megatron-core 0.16): full rotary, theta."""
    return {"rotary_percent": 1.0, "rotary_base": float(model.rope_theta)}


def translate_config(model: Qwen3MoeConfig, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The typed config (HF ``Qwen3MoeConfig`` keys) -> (``TransformerConfig``, knobs: every setting chosen and why);
    `expert_parallel`: the experts split over that many ranks."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers, experts, topk = model.num_hidden_layers, model.num_experts, model.num_experts_per_tok
    model_moe_layers = family_of("qwen3_moe").moe_layers(model)
    freq = [1 if layer in model_moe_layers else 0 for layer in range(layers)]
    pre_softmax = not model.norm_topk_prob
    knobs = {
        "spec": "get_gpt_decoder_block_spec(use_transformer_engine=False, normalization='RMSNorm'), as Bridge's "
                "Qwen3MoEBridge (use_transformer_engine=HAVE_TE): local modules, WrappedTorchNorm (torch.nn.RMSNorm) "
                "for every norm incl. q_layernorm / k_layernorm and the final one; each MoE layer's router with the "
                "routing record (adapters)",
        "moe_layer_freq": (f"{freq} (every layer MoE: Bridge's decoder_sparse_step 1)" if all(freq) else
                           f"{freq}: mlp_only_layers / decoder_sparse_step as HF reads them (a diagnostic case; the "
                           "real models and Bridge have every layer MoE)"),
        "num_query_groups / kv_channels": f"{model.num_key_value_heads} / {model.head_dim} (num_key_value_heads, "
                                          "head_dim: Bridge's CONFIG_MAPPING)",
        "add_qkv_bias / add_bias_linear": "False / False (Bridge: Qwen3 MoE has no QKV bias)",
        "qk_layernorm": "True (Bridge): RMSNorm over each head of q and k before RoPE",
        "rotary_percent / rotary_base": f"1.0 / {float(model.rope_theta)} (rope_theta): GPTModel arguments",
        "softmax_scale": "head_dim ** -0.5, HF's scaling (Megatron's default 1 / math.sqrt(head_dim) is the same "
                         "float32; in float64 it is one ulp away at head_dim 128)",
        "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert (Bridge: True, a CUDA grouped GEMM)",
        "moe_token_dispatcher_type": "allgather" + (
            f": expert_model_parallel_size {expert_parallel}" if expert_parallel > 1 else " (one expert-parallel "
            "rank; Bridge: alltoall)"),
        "moe_router_score_function": "softmax (Bridge: the default), no expert bias, no top-k scaling",
        "moe_router_pre_softmax": f"{pre_softmax} = not norm_topk_prob (Bridge): "
                                  + ("top-k on the logits, then a float32 softmax over those k (HF: softmax over all "
                                     "experts, top-k, divided by their sum: equal in exact arithmetic only)"
                                     if not pre_softmax else "softmax over all experts, then top-k (HF's order)"),
        "moe_router_dtype": "None (Bridge): the gating GEMM in the model's dtype, as HF's Qwen3MoeTopKRouter; "
                            "Megatron's softmax is float32 and cast back to the model dtype (bf16 in a bf16 case: HF "
                            "keeps its routing weights in float32)",
        "moe_router_load_balancing_type": "none, moe_aux_loss_coeff 0: no auxiliary loss in the gradients (Bridge: "
                                          "aux_loss 1e-3; HF computes none without output_router_logits)",
        "bias_activation_fusion": "True: SwiGLU through bias_swiglu_impl / weighted_bias_swiglu_impl (hand-written "
                                  "backward), eager (TORCHDYNAMO_DISABLE=1), as Bridge",
        "attention_softmax_in_fp32": "True: FusedScaleMaskSoftmax's unfused path upcasts bf16 scores "
                                     "(no-op in fp32/64)",
        "masked_softmax_fusion": "False: the torch softmax path (the fused kernels are CUDA extensions)",
        "apply_rope_fusion": "False: unfused RoPE (_apply_rotary_pos_emb_bshd)",
        "cross_entropy_loss_fusion": "False: tensor_parallel.vocab_parallel_cross_entropy (fp32 logits)",
        "hidden_dropout / attention_dropout": "0.0",
        "attention_backend": "local: the local spec's DotProductAttention",
        "share_embeddings_and_output_weights": "False (tie_word_embeddings)",
        "params_dtype": f"{dtype}: GPTModel cast with .to(dtype) as Float16Module does for bf16 (norm weights "
                        "included)",
    }
    config = TransformerConfig(
        num_layers=layers, hidden_size=model.hidden_size, ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim, add_qkv_bias=False, qk_layernorm=True, softmax_scale=model.head_dim ** -0.5,
        normalization="RMSNorm", layernorm_epsilon=float(model.rms_norm_eps), attention_backend=AttnBackend.local,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_ffn_hidden_size=model.moe_intermediate_size, moe_router_topk=topk,
        moe_layer_freq=freq, moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax,
        moe_router_dtype=None, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    return config, knobs
