"""Qwen2-MoE on Megatron-Core: the HF config translated to ``TransformerConfig``. ``harness.runners.megatron.model``
builds, loads and runs the ``GPTModel`` (local spec: plain ``SelfAttention`` with a biased ``linear_qkv`` and the
local ``DotProductAttention``; ``MoELayer`` with a softmax ``TopKRouter``, ``SequentialMLP`` and ``SharedExpertMLP``
with its sigmoid gate).

Where each setting comes from. NVIDIA's Megatron Bridge has no Qwen2-MoE bridge or provider (read in the index:
``src/megatron/bridge/models/qwen/`` lists qwen2, qwen3, qwen3_moe, qwen3_next, qwen35 bridges, none for
``Qwen2MoeForCausalLM``); the settings are those of its Qwen2 and Qwen3-MoE providers, its Qwen3-Next provider for the
shared expert's gate, and the one Qwen2-MoE bridge found, in a fork:
- NVIDIA-NeMo/Megatron-Bridge ``src/megatron/bridge/models/qwen/qwen_provider.py`` @
  07d0d14aceb47916885f74abeace7ac5d167aa75: ``Qwen2ModelProvider`` (RMSNorm, SiLU gated linear unit,
  ``add_bias_linear`` False, ``add_qkv_bias`` True, layernorm_epsilon 1e-6, rotary_base 1e6, dropout 0, untied
  embeddings); ``Qwen3MoEModelProvider`` (softmax router, grouped GEMM, alltoall dispatcher, aux loss 1e-3, no
  ``moe_router_dtype``); ``Qwen3NextModelProvider`` (``moe_shared_expert_gate`` True, "a gate for the shared expert":
  Megatron-Core's ``SharedExpertMLP`` gate, ``sigmoid(F.linear(x, gate_weight)) * output``, HF's
  ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``; ``moe_shared_expert_intermediate_size`` the shared expert's
  width).
- NVIDIA-NeMo/Megatron-Bridge ``src/megatron/bridge/models/qwen/qwen3_moe_bridge.py`` @
  07d0acf5c150eeb797ee4a8d4cb9b33e4bac9d69, ``Qwen3MoEBridge.provider_bridge``: ``moe_router_pre_softmax = not
  norm_topk_prob``. Qwen2-MoE's norm_topk_prob is false: pre_softmax True, the softmax over all experts, then the
  top-k, HF's order and arithmetic (both in float32).
- auto-mas/Megatron-Bridge-Param (a fork of Megatron Bridge) ``src/megatron/bridge/models/qwen/qwen2_moe_bridge.py``
  @ 64c1126cb1d14f404550a7ec8338e9bb40ffa57e, ``Qwen2MoEBridge``: ``add_qkv_bias`` True, ``qk_layernorm`` False,
  ``moe_shared_expert_gate`` True; its mapping: linear_qkv weight and bias by QKVMapping, ``mlp.shared_experts.
  linear_fc1`` from ``mlp.shared_expert.gate_proj`` / ``up_proj``, ``linear_fc2`` from ``down_proj``,
  ``mlp.shared_experts.gate_weight`` from ``mlp.shared_expert_gate.weight`` (names.toml).
Where the harness departs from Bridge, for a CPU run that compares bits with HF (each in ``knobs``): no auxiliary loss,
SequentialMLP (Bridge: grouped GEMM, a CUDA kernel), the allgather dispatcher (Bridge: alltoall, for expert
parallelism), no fusions (CUDA kernels), ``softmax_scale`` HF's ``head_dim ** -0.5``, and ``moe_layer_freq`` from
``mlp_only_layers`` / ``decoder_sparse_step`` when a diagnostic case makes layers dense.

The routing record is Qwen3-MoE's (``harness.families.qwen3_moe.megatron``): Megatron-Core's ``TopKRouter`` with an
identity child (``routing_record``) it hands its (probs, routing_map) to, which returns the probabilities widened to
float32 for the capture hook; the router's own outputs, and so the model's computation, are unchanged (``ADAPTERS``).
"""

from __future__ import annotations

import torch

from harness.families import FamilyConfig as Qwen2MoeConfig
from harness.families import family_of
from harness.families.qwen3_moe.megatron import moe_submodules, routing_record_router

IMPLEMENTATION = ("megatron.core.models.gpt.GPTModel, local spec (no TE): SelfAttention (linear_qkv with bias, local "
                  "DotProductAttention), MoELayer(TopKRouter softmax, SequentialMLP, SharedExpertMLP with "
                  "gate_weight), WrappedTorchNorm RMSNorm, RotaryEmbedding, vocab_parallel_cross_entropy")
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
    """The local spec's modules as they are, and in a MoE layer the router with its routing record."""
    submodules = moe_submodules(getattr(spec.submodules, "mlp", None))
    if "routing_record" not in skip and submodules is not None:
        submodules.router = routing_record_router()


def gpt_model_kwargs(model: Qwen2MoeConfig) -> dict:
    """GPTModel's own RoPE arguments (not TransformerConfig fields in megatron-core 0.16): full rotary, theta."""
    return {"rotary_percent": 1.0, "rotary_base": float(model.rope_theta)}


def translate_config(model: Qwen2MoeConfig, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The typed config (HF ``Qwen2MoeConfig`` keys) -> (``TransformerConfig``, knobs: every setting chosen and why);
    `expert_parallel`: the experts split over that many ranks."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers, experts, topk = model.num_hidden_layers, model.num_experts, model.num_experts_per_tok
    model_moe_layers = family_of("qwen2_moe").moe_layers(model)
    head_dim = model.hidden_size // model.num_attention_heads
    freq = [1 if layer in model_moe_layers else 0 for layer in range(layers)]
    pre_softmax = not model.norm_topk_prob
    knobs = {
        "spec": "get_gpt_decoder_block_spec(use_transformer_engine=False, normalization='RMSNorm'): local modules, "
                "WrappedTorchNorm (torch.nn.RMSNorm) for every norm; each MoE layer's router with the routing record "
                "(adapters)",
        "moe_layer_freq": (f"{freq} (every layer MoE: decoder_sparse_step 1)" if all(freq) else
                           f"{freq}: mlp_only_layers / decoder_sparse_step as HF reads them (a diagnostic case; the "
                           "real models have every layer MoE)"),
        "num_query_groups / kv_channels": f"{model.num_key_value_heads} / {head_dim} (num_key_value_heads, "
                                          "hidden / heads)",
        "add_qkv_bias / add_bias_linear": "True / False (Bridge's Qwen2ModelProvider; the fork's Qwen2MoEBridge): "
                                          "q, k and v biased, no other linear",
        "qk_layernorm": "False (Qwen2 has no q/k norm)",
        "rotary_percent / rotary_base": f"1.0 / {float(model.rope_theta)} (rope_theta): GPTModel arguments",
        "softmax_scale": "head_dim ** -0.5, HF's scaling (Megatron's default 1 / math.sqrt(head_dim) is the same "
                         "float32)",
        "moe_shared_expert_intermediate_size / moe_shared_expert_gate":
            f"{model.shared_expert_intermediate_size} / True: SharedExpertMLP, its output scaled by "
            "sigmoid(F.linear(x, gate_weight)) (Bridge's Qwen3NextModelProvider; the fork's Qwen2MoEBridge), HF's "
            "shared_expert_gate",
        "moe_shared_expert_overlap": "False (the default): the shared expert runs in MoELayer.forward, not overlapped "
                                     "with the dispatcher",
        "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert (Bridge: True, a CUDA grouped GEMM)",
        "moe_token_dispatcher_type": "allgather" + (
            f": expert_model_parallel_size {expert_parallel}" if expert_parallel > 1 else " (one expert-parallel "
            "rank; Bridge: alltoall)"),
        "moe_router_score_function": "softmax (Bridge: the default), no expert bias, no top-k scaling",
        "moe_router_pre_softmax": f"{pre_softmax} = not norm_topk_prob (Bridge's Qwen3MoEBridge rule): "
                                  + ("softmax over all experts in float32, then top-k (HF's order), no "
                                     "renormalisation" if pre_softmax else
                                     "top-k on the logits, then a float32 softmax over those k (HF: softmax over all "
                                     "experts, top-k, divided by their sum: equal in exact arithmetic only)"),
        "moe_router_dtype": "None (Bridge's Qwen3MoEModelProvider): the gating GEMM in the model's dtype, as HF's "
                            "Qwen2MoeTopKRouter; Megatron's softmax is float32 and cast back to the model dtype "
                            "(bf16 in a bf16 case: HF keeps its routing weights in float32)",
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
        kv_channels=head_dim, add_qkv_bias=True, qk_layernorm=False, softmax_scale=head_dim ** -0.5,
        normalization="RMSNorm", layernorm_epsilon=float(model.rms_norm_eps), attention_backend=AttnBackend.local,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_ffn_hidden_size=model.moe_intermediate_size, moe_router_topk=topk,
        moe_shared_expert_intermediate_size=model.shared_expert_intermediate_size, moe_shared_expert_gate=True,
        moe_shared_expert_overlap=False,
        moe_layer_freq=freq, moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax,
        moe_router_dtype=None, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    return config, knobs
