"""Every model family on Megatron-Core, from its architecture (``Family.architecture``) and what its
``harness/families/<family>/megatron.toml`` says: one builder, each block written once.

- ``translate_config``: the typed config -> (``TransformerConfig``, knobs: every setting chosen and why). Attention
  "gqa" is ``SelfAttention`` on ``linear_qkv`` (num_query_groups, kv_channels, the qkv bias, per-head q/k norm,
  partial rotary through GPTModel's rotary_percent); the MoE block is ``MoELayer(TopKRouter, SequentialMLP,
  SharedExpertMLP)`` with the router's scoring, top-k normalisation, expert bias and scaling, and the shared expert's
  gate read from the architecture. Every setting the harness departs from Megatron Bridge's providers in, for a CPU
  run that compares bits with HF, is the same for every family: no auxiliary loss, SequentialMLP (Bridge: grouped
  GEMM, a CUDA kernel), the allgather dispatcher (Bridge: alltoall), no fusions (CUDA kernels), HF's
  ``head_dim ** -0.5`` softmax scale. A family's megatron.toml holds its implementation text, the knob texts that
  cite its own Bridge provider, its Bridge citations (file @ commit), and its switches (``router_dtype``,
  ``bias_update_rate``, ``routing_record``, ``group_limited_routing``), or, for a family no released
  Megatron-Core builds, only ``unsupported`` (the UNSUPPORTED text: DeepSeek-V4).
- Quirks, each named where it is handled: MLA (attention kind "mla": ``MLATransformerConfig``, YaRN, its core
  attention and ``HAVE_TE``), DeepSeek-V3's group-limited routing, the all-heads q/k norm (qk_norm "all_heads":
  MiniMax-M2), the sigmoid router's top-1 (Megatron leaves a single score unnormalised), Gated DeltaNet layers
  (Qwen3.5-MoE: megatron-core >= 0.19 with fla, the local GDN spec of ``harness.runners.megatron.gdn``).

``harness.runners.megatron.model`` builds, loads and runs the ``GPTModel``; the modules the local spec lacks are in
``harness.runners.megatron.blocks``.
"""

from __future__ import annotations

import torch

from harness.families import FamilyConfig
from harness.families.expressions import evaluate
from harness.run.cell_state import patch
from harness.run.protocol import Unsupported
from harness.runners.megatron import blocks, dsa, gdn

MLA_CORE_ATTENTION = "MLADotProductAttention"
MLA_HAVE_TE = "mla_have_te_false"
FULL_DIM_QK_NORM = "FullDimQKNorm"
ROUTING_RECORD = "routing_record"
DSA_LOCAL_SPEC = "LocalDSASpecProvider"
GDN_LOCAL_SPEC = "local_gated_delta_net_spec"
ADAPTERS = {
    MLA_CORE_ATTENTION: "subclass of megatron.core.transformer.dot_product_attention.DotProductAttention that "
    "accepts MLASelfAttention's k_channels/v_channels keywords (the local class refuses them) and sizes its output "
    "view [s, b, heads * v_head_dim] from v_channels; scores, softmax and context are the parent's code",
    MLA_HAVE_TE: "without Transformer Engine: multi_latent_attention.HAVE_TE = False. Megatron's TE extension "
    "module imports with MagicMock stand-ins, so MLA believes TE is present and its isinstance(linear_proj, TELinear) "
    "check (fp8/fp4 only) raises TypeError on the mock; the flag only guards TE/fp8 branches",
    FULL_DIM_QK_NORM: "a module the family needs that Megatron-Core's local spec lacks; Megatron Bridge provides it "
    "in its TE spec (src/megatron/bridge/models/minimax_m2/minimax_m2_provider.py @ "
    "46bab91db74f1a2a211ef505ec76d0428b3da984: _FullDimRMSNorm via FullDimQNorm / FullDimKNorm). "
    "harness.runners.megatron.blocks.FullDimQNorm / FullDimKNorm, in every layer's local spec as q_layernorm / "
    "k_layernorm: one RMSNorm over all heads of a token (float32 sum of squares / (heads x head_dim), rsqrt(+eps), "
    "weight * x.to(dtype); float64 in a float64 run), as Bridge's and as transformers' MiniMaxM2RMSNorm; "
    "megatron-core 0.16.1's own q_layernorm is sized to one head (transformer/attention.py, SelfAttention)",
    DSA_LOCAL_SPEC: "megatron-core >= 0.19's DSA layer spec (get_transformer_layer_with_experimental_attention_"
    "variant_spec) built on megatron.core.models.backends.LocalSpecProvider plus the linear() it lacks: Megatron's "
    "local Linear (megatron.core.post_training.modelopt.layers.Linear, torch.nn.Linear) for the indexer's "
    "linear_wq_b / linear_wk / linear_weights_proj, ColumnParallelLinear for AbsorbedMLASelfAttention's "
    "linear_q_down_proj / linear_kv_down_proj as in Megatron's local MLA spec (tensor-parallel size 1: one GEMM "
    "each); the block spec Megatron writes for TE only (harness.runners.megatron.dsa)",
    GDN_LOCAL_SPEC: "megatron-core >= 0.19's Gated DeltaNet without Transformer Engine (its hybrid block spec "
    "asserts TE): every layer Megatron's local GPT layer spec (get_gpt_decoder_layer_specs, use_transformer_engine="
    "False), a linear-attention layer's self_attention Megatron's get_gated_delta_net_module_spec on "
    "LocalSpecProvider with in_proj ColumnParallelLinear behind the layer's own input_layernorm (the spec asks TE's "
    "fused norm + linear, which the local provider has not): the same norm, then the same GEMM, unfused "
    "(harness.runners.megatron.gdn)",
    ROUTING_RECORD: "each MoE layer's router is megatron.core's TopKRouter with one identity child "
    "(routing_record) it passes its (probs, routing_map) to; the child returns the probabilities "
    "widened to float32 (exact) for the capture hook, and the router returns its own outputs "
    "unchanged (Megatron's softmax router holds bf16 probabilities in a bf16 model; the contract "
    "writes float32)",
}

# Knob texts every family shares unless its megatron.toml [knobs] says otherwise; "{name}": a value of the context
# (``_context``: the config's keys and the settings chosen here).
KNOBS = {
    "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert (Bridge: True, a CUDA grouped GEMM)",
    "moe_token_dispatcher_type": {"if": "ep > 1", "then": "allgather: expert_model_parallel_size {ep}",
                                  "else": "allgather (one expert-parallel rank; Bridge: alltoall)"},
    "bias_activation_fusion": "True: SwiGLU through bias_swiglu_impl / weighted_bias_swiglu_impl (hand-written "
                              "backward), eager (TORCHDYNAMO_DISABLE=1), as Bridge",
    "attention_softmax_in_fp32": "True: FusedScaleMaskSoftmax's unfused path upcasts bf16 scores (no-op in fp32/64)",
    "masked_softmax_fusion": "False: the torch softmax path (the fused kernels are CUDA extensions)",
    "cross_entropy_loss_fusion": "False: tensor_parallel.vocab_parallel_cross_entropy (fp32 logits)",
    "hidden_dropout / attention_dropout": "0.0",
    "attention_backend": "local: the local spec's DotProductAttention",
    "share_embeddings_and_output_weights": "False (tie_word_embeddings)",
}
GQA_KNOBS = {
    "num_query_groups / kv_channels": "{kv_heads} / {kv_channels} (num_key_value_heads, head_dim: Bridge's "
                                      "CONFIG_MAPPING)",
    "rotary_percent / rotary_base": "{rotary_percent} / {rotary_base} (rope_theta): GPTModel arguments",
    "softmax_scale": "head_dim ** -0.5, HF's scaling (Megatron's default 1 / math.sqrt(head_dim) is the same "
                     "float32)",
    "apply_rope_fusion": {"if": "rotary_percent < 1",
                          "then": "False: unfused RoPE (_apply_rotary_pos_emb_bshd on the first rotary_percent dims)",
                          "else": "False: unfused RoPE (_apply_rotary_pos_emb_bshd)"},
}
PARAMS_DTYPE = "{dtype}: GPTModel cast with .to(dtype) as Float16Module does for bf16 (norm weights included)"
EXPERT_BIAS_DTYPE = "; the router's expert_bias stays float32 (Megatron keeps it so)"
MLA_KNOBS = {  # MLA's own: its RoPE is de-interleaved inside the attention (no rotary_percent, no softmax_scale knob)
    "apply_rope_fusion": "False: unfused MLA RoPE (_apply_rotary_pos_emb_bshd, de-interleaving HF's rope dims)",
}


def settings(model: FamilyConfig) -> dict:
    """The family's megatron.toml (empty where it has none)."""
    return model.record.stack("megatron")


def implementation(model: FamilyConfig) -> str:
    """meta.json ``implementation``: the modules GPTModel is built of, for this family."""
    return settings(model)["implementation"]


def adapters(model: FamilyConfig) -> list[str]:
    """The family's adapters, by name: the modules its architecture needs that the local spec lacks."""
    attention = model.record.architecture(model).attention
    names = [MLA_CORE_ATTENTION] if attention.kind == "mla" and attention.indexer is None else []
    names += [DSA_LOCAL_SPEC] if attention.indexer is not None else []
    names += [GDN_LOCAL_SPEC] if model.record.architecture(model).linear_attention is not None else []
    names += [FULL_DIM_QK_NORM] if attention.qk_norm == "all_heads" else []
    return names + ([ROUTING_RECORD] if settings(model).get("routing_record") else [])


def install_adapters(model: FamilyConfig, skip=(), te_installed: bool = False) -> list[str]:
    """The family's adapters (all but those in `skip`, for the tests that show each one is needed), by name; MLA's
    ``HAVE_TE`` patch lasts for this cell only (``harness.run.cell_state.patch``); the others go in with the layer
    spec (``layer_spec``)."""
    names = [name for name in adapters(model) if name not in skip]
    if model.record.architecture(model).attention.kind == "mla":  # quirk: MLA without Transformer Engine
        from megatron.core.transformer import multi_latent_attention

        if not te_installed and multi_latent_attention.HAVE_TE and MLA_HAVE_TE not in skip:
            patch(multi_latent_attention, "HAVE_TE", False)
            names.append(MLA_HAVE_TE)
    return names


def _megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def layer_spec(model: FamilyConfig, spec, skip=()) -> None:
    """The family's modules in one layer's spec (in place): MLA's core attention, the all-heads q/k norm, the router
    with its routing record; each skipped when named in `skip` (the local spec's own module stays)."""
    wanted = [name for name in adapters(model) if name not in skip]
    attention = model.record.architecture(model).attention
    if attention.kind == "mla" and attention.indexer is None:  # DSA's core attention is DSAttention
        spec.submodules.self_attention.submodules.core_attention = (
            blocks.MLADotProductAttention if MLA_CORE_ATTENTION in wanted else blocks.DotProductAttention)
    if FULL_DIM_QK_NORM in wanted:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = blocks.FullDimQNorm, blocks.FullDimKNorm
    submodules = blocks.moe_submodules(getattr(spec.submodules, "mlp", None))
    if ROUTING_RECORD in wanted and submodules is not None:
        submodules.router = blocks.routing_record_router()


def decoder_block_spec(model: FamilyConfig, config, layer_norm):
    """The decoder block's spec: Megatron's local GPT spec, or for a DSA family the local DSA spec
    (``harness.runners.megatron.dsa``), for Gated DeltaNet layers the local GDN spec (``...megatron.gdn``)."""
    if model.record.architecture(model).attention.indexer is not None:
        return dsa.block_spec(config, layer_norm)
    if model.record.architecture(model).linear_attention is not None:
        return gdn.block_spec(config, layer_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    spec.layer_norm = layer_norm
    return spec


def gpt_model_kwargs(model: FamilyConfig) -> dict:
    """GPTModel's own RoPE arguments (not TransformerConfig fields in megatron-core 0.16): the rotated share of each
    head, the base; none for MLA (it applies its YaRN RoPE inside the attention)."""
    attention = model.record.architecture(model).attention
    if attention.kind == "mla":
        return {}
    return {"rotary_percent": attention.rotary_dim / attention.head_dim, "rotary_base": float(attention.rope_theta)}


def translate_config(model: FamilyConfig, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The typed config -> (``TransformerConfig`` or MLA's, knobs: every setting chosen and why); `expert_parallel`:
    the experts split over that many ranks (a training run's train.ep)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    arch = model.record.architecture(model)
    attention, moe, own = arch.attention, arch.moe, settings(model)
    if "unsupported" in own:  # a family no released Megatron-Core builds (DeepSeek-V4): its megatron.toml says why
        raise Unsupported(own["unsupported"].format(version=_megatron_version()))
    if moe is None:
        raise Unsupported("a family without MoE layers is not mapped")
    if attention.indexer is not None:  # GLM-5, DeepSeek-V3.2 (docs/model.md, "GLM-5 (glm_moe_dsa)")
        dsa.require()
    if arch.linear_attention is not None:  # Qwen3.5-MoE (docs/model.md, "Qwen3.5-MoE (qwen3_5_moe)")
        gdn.require()
    _refuse_unmapped_routing(moe)
    router_dtype = own.get("router_dtype") or None
    if dtype == torch.float64 and own.get("router_fp64_in_float64", True):
        router_dtype = "fp64"
    freq = [1 if arch.is_moe(layer) else 0 for layer in range(arch.layers)]
    pre_softmax = moe.scoring == "softmax" and not moe.norm_topk
    common = dict(
        num_layers=arch.layers, hidden_size=arch.hidden, ffn_hidden_size=arch.dense_ffn,
        num_attention_heads=attention.heads, normalization="RMSNorm", layernorm_epsilon=float(arch.norm_eps),
        attention_backend=AttnBackend.local, add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=True, masked_softmax_fusion=False,
        attention_softmax_in_fp32=True, apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=moe.experts, moe_ffn_hidden_size=moe.ffn, moe_router_topk=moe.topk, moe_layer_freq=freq,
        moe_shared_expert_intermediate_size=moe.shared_ffn or None, moe_shared_expert_gate=moe.shared_gate,
        moe_router_score_function=moe.scoring, moe_router_enable_expert_bias=bool(moe.expert_bias),
        moe_router_pre_softmax=pre_softmax,
        moe_router_topk_scaling_factor=float(moe.topk_scaling) if moe.topk_scaling != 1.0 else None,
        moe_router_dtype=router_dtype, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    if "bias_update_rate" in own:
        common["moe_router_bias_update_rate"] = float(own["bias_update_rate"])
    if own.get("group_limited_routing"):
        common.update(_group_limited_routing(model, moe))
    if attention.kind == "mla":
        config = MLATransformerConfig(**common, **_mla(model, attention), **_dsa(model, attention))
        knobs = dict(MLA_KNOBS)
    else:
        config = TransformerConfig(
            **common, num_query_groups=attention.kv_heads, kv_channels=attention.head_dim,
            add_qkv_bias=attention.qkv_bias, qk_layernorm=attention.qk_norm != "none",
            softmax_scale=attention.head_dim ** -0.5, **_gated_delta_net(arch))
        knobs = dict(GQA_KNOBS)
    context = _context(model, arch, dtype, expert_parallel, router_dtype, freq, pre_softmax)
    context.update(router_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk)
    knobs.update(KNOBS)
    knobs["params_dtype"] = PARAMS_DTYPE + (EXPERT_BIAS_DTYPE if moe.expert_bias else "")
    knobs.update(own.get("knobs", {}))
    return config, {name: _text(text, context) for name, text in knobs.items()}


def _gated_delta_net(arch) -> dict:
    """Qwen3.5-MoE's fields (none without linear-attention layers): Gated DeltaNet on the layers the config names,
    the output-gated attention on the others, and ``deterministic_mode`` (GatedDeltaNet's torch conv and delta rule
    instead of fla's kernels; the embedding's lookup by indexing: megatron.toml's knobs say what it changes)."""
    linear = arch.linear_attention
    if linear is None:
        return {}
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[1 if layer in arch.linear_layers else 0 for layer in range(arch.layers)],
                linear_conv_kernel_dim=linear.conv_kernel, linear_key_head_dim=linear.key_head_dim,
                linear_value_head_dim=linear.value_head_dim, linear_num_key_heads=linear.key_heads,
                linear_num_value_heads=linear.value_heads, attention_output_gate=arch.attention.output_gate,
                deterministic_mode=True)


def _refuse_unmapped_routing(moe) -> None:
    """Routing Megatron-Core 0.16.1 computes otherwise than HF: UNSUPPORTED, never a DIFF of the mapping's making."""
    if moe.scoring != "sigmoid":
        return
    if not moe.norm_topk and moe.topk > 1:
        raise Unsupported("Megatron's sigmoid router always normalises the top-k probabilities "
                          "(norm_topk_prob false)")
    if moe.norm_topk and moe.topk == 1:
        raise Unsupported("Megatron's sigmoid router leaves a single top-1 score unnormalised "
                          "(moe_utils.topk_routing_with_score_function: probs = scores when topk == 1); HF divides "
                          "it by itself (num_experts_per_tok 1)")


def _group_limited_routing(model: FamilyConfig, moe) -> dict:
    """Quirk (megatron.toml ``group_limited_routing``, DeepSeek-V3): the experts in ``n_group`` groups, the top
    ``topk_group`` groups chosen first. HF picks groups by the sum of each group's top-2 scores; Megatron by the sum of
    its top (topk // group_topk): the same only where that is 2."""
    n_group, topk_group = model.n_group or 1, model.topk_group or 1
    if n_group > 1 and moe.topk // topk_group != 2:
        raise Unsupported(f"group-limited routing with topk {moe.topk} / topk_group {topk_group} != 2 "
                          "(HF sums each group's top-2)")
    return dict(moe_router_num_groups=n_group if n_group > 1 else None,
                moe_router_group_topk=topk_group if n_group > 1 else None)


def _mla(model: FamilyConfig, attention) -> dict:
    """Quirk (attention kind "mla", DeepSeek-V3): ``MLATransformerConfig``'s own fields, YaRN from the config's
    ``rope_scaling``; HF's interleaved rope dims are de-interleaved by Megatron's MLA RoPE only."""
    def need(condition, why):
        if not condition:
            raise Unsupported(why)

    need(attention.q_lora_rank is not None, "q_lora_rank None (linear_q_proj) is not mapped")
    rope = getattr(model, "rope_scaling", None)  # GLM-5 has no key: plain RoPE
    need(rope is None or rope.type in ("yarn", "default"), f"rope_scaling type {rope and rope.type!r}")
    if attention.indexer is None:  # GLM-5's split-half rope dims are permuted on loading (name map: rope_rows)
        need(model.rope_interleave, "rope_interleave false (Megatron's MLA RoPE de-interleaves)")
    yarn = dict(rope_type="rope", rotary_scaling_factor=1.0)
    if rope is not None and rope.type == "yarn":
        yarn = dict(rope_type="yarn", rotary_scaling_factor=float(rope.factor),
                    original_max_position_embeddings=int(rope.original_max_position_embeddings),
                    beta_fast=float(rope.beta_fast), beta_slow=float(rope.beta_slow),
                    mscale=float(rope.mscale), mscale_all_dim=float(rope.mscale_all_dim))
    return dict(q_lora_rank=attention.q_lora_rank, kv_lora_rank=attention.kv_lora_rank,
                qk_head_dim=attention.head_dim - attention.rotary_dim, qk_pos_emb_head_dim=attention.rotary_dim,
                v_head_dim=attention.v_head_dim, rotary_base=float(attention.rope_theta), qk_layernorm=True, **yarn)


def _dsa(model: FamilyConfig, attention) -> dict:
    """DeepSeek Sparse Attention's fields (megatron-core >= 0.19; none without an indexer): the indexer as the
    family's megatron.toml [dsa] says HF computes it (GLM-5: no ReLU, split-half RoPE, k_norm eps 1e-6), no Hadamard
    rotation (HF has none) and no indexer loss (HF trains no indexer); its knobs ``dsa_*`` say where Megatron Bridge
    differs. A family without a [dsa] table (DeepSeek-V3.2, whose HF indexer applies a ReLU) is not mapped."""
    indexer = attention.indexer
    if indexer is None:
        return {}
    own = settings(model).get("dsa")
    if own is None:
        raise Unsupported(f"the harness maps DeepSeek Sparse Attention on Megatron-Core for GLM-5 only: family "
                          f"{model.family!r} has no [dsa] table in its megatron.toml")
    return dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=indexer.heads,
                dsa_indexer_head_dim=indexer.head_dim, dsa_indexer_topk=indexer.topk,
                dsa_indexer_rotate_activation=False, dsa_indexer_loss_coeff=0.0,
                dsa_indexer_scoring_relu=bool(own["scoring_relu"]),
                dsa_indexer_k_norm_epsilon=float(own["k_norm_epsilon"]),
                dsa_indexer_rope_interleaved=bool(own["rope_interleaved"]))


def _context(model, arch, dtype, expert_parallel, router_dtype, freq, pre_softmax) -> dict:
    """What a knob text may name: the config's keys, then the settings chosen (these win)."""
    attention, moe = arch.attention, arch.moe
    return {**model.to_dict(), "ep": expert_parallel, "dtype": str(dtype), "float64": dtype == torch.float64,
            "router_dtype": router_dtype, "freq": freq, "all_moe": all(freq), "dense": len(arch.dense_layers),
            "pre_softmax": pre_softmax, "kv_heads": attention.kv_heads, "kv_channels": attention.head_dim,
            "rotary_dim": attention.rotary_dim, "rotary_percent": attention.rotary_dim / attention.head_dim,
            "rotary_base": float(attention.rope_theta), "topk_scaling": float(moe.topk_scaling),
            "expert_ffn": moe.ffn, "shared_ffn": moe.shared_ffn}


def _text(knob, context: dict) -> str:
    """A knob's text: a template, or ``{if, then, else}`` (``if``: an expression over the context)."""
    if isinstance(knob, dict):
        knob = knob["then"] if evaluate(knob["if"], context) else knob["else"]
    return knob.format(**context)
