"""DeepSeek-V3 on Megatron-Core: the HF config translated to ``MLATransformerConfig``, and the adapters MLA needs on
the local (no Transformer Engine) spec. ``harness.runners.megatron.model`` builds, loads and runs the ``GPTModel``.

- ``MLADotProductAttention``: the local ``DotProductAttention`` refuses the ``k_channels``/``v_channels`` that
  ``MLASelfAttention`` passes. The subclass accepts them and sizes its output view with ``v_channels`` (MLA's v head
  dim differs from the qk head dim); the scores and context are the parent's own code, with MLA's softmax scale.
- ``mla_have_te_false`` (without Transformer Engine): see ``ADAPTERS``.
"""

from __future__ import annotations

import torch

from harness.families import FamilyConfig as DeepseekV3Config
from harness.run.cell_state import patch
from harness.run.protocol import Unsupported

try:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
except Exception:  # noqa: BLE001 - the runner reports a missing or broken Megatron-Core before it builds anything
    DotProductAttention = object

IMPLEMENTATION = ("megatron.core.models.gpt.GPTModel, local spec (no TE): MLASelfAttention (MLADotProductAttention), "
                  "MoELayer(TopKRouter, SequentialMLP, SharedExpertMLP), WrappedTorchNorm RMSNorm, "
                  "vocab_parallel_cross_entropy")


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


ADAPTERS = {
    "MLADotProductAttention": "subclass of megatron.core.transformer.dot_product_attention.DotProductAttention that "
    "accepts MLASelfAttention's k_channels/v_channels keywords (the local class refuses them) and sizes its output "
    "view [s, b, heads * v_head_dim] from v_channels; scores, softmax and context are the parent's code",
    "mla_have_te_false": "without Transformer Engine: multi_latent_attention.HAVE_TE = False. Megatron's TE extension "
    "module imports with MagicMock stand-ins, so MLA believes TE is present and its isinstance(linear_proj, TELinear) "
    "check (fp8/fp4 only) raises TypeError on the mock; the flag only guards TE/fp8 branches",
}


def install_adapters(skip=(), te_installed: bool = False) -> list[str]:
    """This family's adapters (all but those in `skip`, for the tests that show each one is needed), by name; each
    patch lasts for this cell only (``harness.run.cell_state.patch``)."""
    from megatron.core.transformer import multi_latent_attention

    names = [] if "MLADotProductAttention" in skip else ["MLADotProductAttention"]
    if not te_installed and multi_latent_attention.HAVE_TE and "mla_have_te_false" not in skip:
        patch(multi_latent_attention, "HAVE_TE", False)
        names.append("mla_have_te_false")
    return names


def core_attention(skip=()):
    """The core attention every layer's spec gets: MLADotProductAttention, or (skipped) the local class itself."""
    return DotProductAttention if "MLADotProductAttention" in skip else MLADotProductAttention


def layer_spec(spec, skip=()) -> None:
    """The family's modules in one layer's spec (in place): MLA's core attention (``core_attention``)."""
    spec.submodules.self_attention.submodules.core_attention = core_attention(skip)


def gpt_model_kwargs(model: DeepseekV3Config) -> dict:
    """GPTModel's own arguments beyond the config: none (MLA applies its YaRN RoPE inside the attention)."""
    return {}


def translate_config(model: DeepseekV3Config, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The typed config (HF ``DeepseekV3Config`` keys) -> (``MLATransformerConfig``, knobs: every setting chosen and
    why); `expert_parallel`: the experts split over that many ranks (a training run's train.ep)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def need(condition, why):
        if not condition:
            raise Unsupported(f"megatron_model: {why}")

    layers, experts, topk = model.num_hidden_layers, model.n_routed_experts, model.num_experts_per_tok
    need(model.scoring_func == "sigmoid", "only scoring_func sigmoid is mapped")
    need(model.norm_topk_prob or topk == 1,
         "Megatron's sigmoid router always normalises the top-k probabilities (norm_topk_prob false)")
    need(not model.tie_word_embeddings, "tied embeddings are not mapped")
    need(not model.attention_bias, "attention_bias is not mapped")
    need(model.num_key_value_heads == model.num_attention_heads,
         "MLA with num_key_value_heads != num_attention_heads")
    need(model.q_lora_rank is not None, "q_lora_rank None (linear_q_proj) is not mapped")
    n_group, topk_group = model.n_group or 1, model.topk_group or 1
    # HF picks groups by the sum of each group's top-2 scores; Megatron by the sum of its top (topk // group_topk).
    need(n_group == 1 or topk // topk_group == 2,
         f"group-limited routing with topk {topk} / topk_group {topk_group} != 2 (HF sums each group's top-2)")
    rope = model.rope_scaling
    rope_type = rope.type
    need(rope_type in ("yarn", "default"), f"rope_scaling type {rope_type!r}")
    need(model.rope_interleave, "rope_interleave false (Megatron's MLA RoPE de-interleaves)")
    dense = int(model.first_k_dense_replace)
    yarn = {}
    if rope_type == "yarn":
        yarn = dict(rope_type="yarn", rotary_scaling_factor=float(rope.factor),
                    original_max_position_embeddings=int(rope.original_max_position_embeddings),
                    beta_fast=float(rope.beta_fast), beta_slow=float(rope.beta_slow),
                    mscale=float(rope.mscale), mscale_all_dim=float(rope.mscale_all_dim))
    else:
        yarn = dict(rope_type="rope", rotary_scaling_factor=1.0)
    router_dtype = "fp64" if dtype == torch.float64 else "fp32"
    knobs = {
        "spec": "get_gpt_decoder_block_spec(use_transformer_engine=False, normalization='RMSNorm'): local modules, "
                "WrappedTorchNorm (torch.nn.RMSNorm) for every norm incl. the final one",
        "moe_layer_freq": f"{dense} dense layer(s) then MoE (first_k_dense_replace)",
        "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert",
        "moe_token_dispatcher_type": "allgather" + (
            f": expert_model_parallel_size {expert_parallel}, every rank all-gathers the tokens and runs its own "
            "experts on those routed to them" if expert_parallel > 1 else " (one expert-parallel rank)"),
        "moe_router_dtype": f"{router_dtype}: the gating GEMM and routing in {router_dtype} (fp32 is Kimi-K2's "
                            "training setting; float64 cases keep float64). Megatron computes sigmoid(logits.float()) "
                            "in fp32 whatever this says",
        "router_gating_gemm": "megatron-core >= 0.19 with Transformer Engine installed: te_general_gemm for a fp32 "
                              "router (Megatron's own choice); otherwise torch (RouterGatingLinearFunction)",
        "moe_router_load_balancing_type": "none, moe_aux_loss_coeff 0: no auxiliary loss in the gradients "
                                          "(HF has none)",
        "moe_router_num_groups": f"{n_group if n_group > 1 else None} (n_group), group_topk "
                                 f"{topk_group if n_group > 1 else None}",
        "bias_activation_fusion": "True: SwiGLU through bias_swiglu_impl / weighted_bias_swiglu_impl (hand-written "
                                  "backward), eager (TORCHDYNAMO_DISABLE=1)",
        "attention_softmax_in_fp32": "True: FusedScaleMaskSoftmax's unfused path upcasts bf16 scores "
                                     "(no-op in fp32/64)",
        "masked_softmax_fusion": "False: the torch softmax path (the fused kernels are CUDA extensions)",
        "apply_rope_fusion": "False: unfused MLA RoPE (_apply_rotary_pos_emb_bshd, de-interleaving HF's rope dims)",
        "cross_entropy_loss_fusion": "False: tensor_parallel.vocab_parallel_cross_entropy (fp32 logits)",
        "hidden_dropout / attention_dropout": "0.0",
        "attention_backend": "local: the local spec's DotProductAttention (with the default 'auto', GPTModel asserts "
                             "on the NVTE_FLASH_ATTN=0 / NVTE_FUSED_ATTN=0 the harness sets on a GPU)",
        "share_embeddings_and_output_weights": "False",
        "deterministic_mode": "False (F.embedding)",
        "params_dtype": f"{dtype}: GPTModel cast with .to(dtype) as Float16Module does for bf16 (norm weights "
                        "included); the router's expert_bias stays float32 (Megatron keeps it so)",
    }
    config = MLATransformerConfig(
        num_layers=layers, hidden_size=model.hidden_size, ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads,
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim,
        rotary_base=float(model.rope_theta), **yarn,
        normalization="RMSNorm", layernorm_epsilon=float(model.rms_norm_eps), qk_layernorm=True,
        attention_backend=AttnBackend.local,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_ffn_hidden_size=model.moe_intermediate_size, moe_router_topk=topk,
        moe_layer_freq=[0] * dense + [1] * (layers - dense),
        moe_shared_expert_intermediate_size=(model.moe_intermediate_size * model.n_shared_experts
                                             if model.n_shared_experts else None),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=float(model.routed_scaling_factor),
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        moe_router_dtype=router_dtype, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    return config, knobs
