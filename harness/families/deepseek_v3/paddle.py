"""DeepSeek-V3 in Paddle: PaddleFormers' ``DeepseekV3ForCausalLM`` (Paddle dygraph, CPU) with its config from the
case's and the knobs that put it on its non-fused paths, the contract's module and gradient names in the order it
writes them, and PaddleFleet's ``GPTModel`` (GPU), read but not yet run. ``harness.runners.paddle.model`` builds, loads
and runs it.

PaddleFleet, as read from its public source (it could not be run here):
  PaddlePaddle/PaddleFleet src/paddlefleet/models/gpt/gpt_layer_specs.py @ aadcacc6930f8fce858b3577aec6cc5acf46ffb4
    (get_gpt_decoder_layers_spec, get_gpt_mtp_layers_spec, get_gpt_spec(..., position_embedding_type="yarn"))
  PaddlePaddle/PaddleFleet src/paddlefleet/models/gpt/gpt_model.py @ 509f514620fe6bf7cec36afdc94472cb7a3add7b
    (GPTModel, a PipelineLayer of embedding, transformer layers, final norm, lm_head)
The GPU path stops at UNSUPPORTED before building anything unless paddlefleet imports; see ``fleet_model``.
"""

from __future__ import annotations

import os

from harness.families import FamilyConfig as DeepseekV3Config
from harness.run.protocol import Phases, Unsupported, import_failure

MODEL = "paddleformers.transformers.deepseek_v3.DeepseekV3ForCausalLM"
# Its MoE layer on an expert-parallel group (harness.runners.paddle.train: DeepEP's all-to-all only)
EXPERT_PARALLEL_LAYER = "DeepseekV3MoEFlexToken"

# PaddleFormers config knobs this runner sets, and why. Everything else comes from the case's HF config keys.
KNOBS = {
    "fuse_rms_norm": (False, "default True calls paddle.incubate fused_rms_norm_ext (a GPU kernel); False takes "
                             "RMSNorm's plain Paddle ops (variance in float32, rsqrt, multiply)"),
    "fuse_swiglu": (False, "the unfused MLP path (silu(gate) * up, gate and up separate linears), as HF computes it"),
    "apply_rope_fusion": (False, "the unfused rotary embedding (rotate_half), no fused_rotary_position_embedding"),
    "_attn_implementation": ("eager", "eager attention (matmul, additive causal mask, float32 softmax, matmul), the "
                                      "path HF's eager attention also takes; sdpa/flashmask are other kernels"),
    "use_fused_linear_cross_entropy": (False, "logits are materialised (the contract captures them); the fused "
                                              "linear+CE is a Triton kernel"),
    "use_fused_head_and_loss_fn": (False, "the same: lm_head then CrossEntropyLoss, not fused"),
    "use_filtered_label_loss": (False, "CE over all positions, masked by labels != -100 (the contract's mean)"),
    "loss_subbatch_sequence_length": (-1, "no sub-batched loss"),
    "moe_subbatch_token_num_before_dispatch": (0, "no sub-batched MoE recompute"),
    "recompute_granularity": (None, "no recomputation: one forward, hooks see each module once"),
    "num_nextn_predict_layers": (0, "no multi-token-prediction layers (the contract has none)"),
    "fd_fallback": (False, "routed experts as a LayerList of per-expert MLPs (capturable per expert), not the fused "
                           "3-D DeepseekV3NaiveMoe"),
    "tensor_model_parallel_size": (1, "TP=1: plain paddle.nn.Linear everywhere"),
    "sequence_parallel": (False, "TP=1"),
    "use_cache": (False, "training forward, no KV cache"),
    "attention_dropout": (0.0, "deterministic"),
}


def adapters() -> list[dict]:
    """The adapters this family's model needs beyond the runner's paddlefleet_ops stand-in: none."""
    return []


def classes():
    """(PaddleFormers' DeepseekV3Config, DeepseekV3ForCausalLM), imported when a run asks for them (paddleformers
    needs the paddlefleet_ops stand-in first: harness.runners.paddle.paddlefleet_ops_shim)."""
    from paddleformers.transformers import deepseek_v3 as formers

    return formers.DeepseekV3Config, formers.DeepseekV3ForCausalLM


def op_router_fields(hidden: int, experts: int, topk: int, scaling: float) -> dict:
    """PaddleFormers' ``DeepseekV3Config`` keywords for one router op (Kimi-K2's op cases, run through
    ``DeepseekV3TopkRouter`` by harness.runners.paddle.formers): one group, normalised top-k, the case's scaling."""
    return {"hidden_size": hidden, "n_routed_experts": experts, "num_experts_per_tok": topk, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": scaling}


def op_experts_fields(hidden: int, ffn: int, experts: int) -> dict:
    """PaddleFormers' ``DeepseekV3Config`` keywords for the routed-experts op (``DeepseekV3MoE`` over its own
    experts; the op passes top-1 routing)."""
    return {"hidden_size": hidden, "moe_intermediate_size": ffn, "intermediate_size": ffn, "n_routed_experts": experts,
            "num_experts_per_tok": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "hidden_act": "silu"}


def op_fleet_router_fields(hidden: int, experts: int, topk: int, scaling: float) -> dict:
    """PaddleFleet's ``TransformerConfig`` keywords for its ``moe_router.TopKRouter`` as DeepSeek-V3 routes
    (noaux_tc, sigmoid, expert bias, normalised top-k, the case's scaling; no aux or z loss)."""
    return {"hidden_size": hidden, "n_routed_experts": experts, "num_experts_per_tok": topk,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": scaling, "router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}


def config_kwargs(m: DeepseekV3Config) -> dict:
    """PaddleFormers' config from the case's: its HF keys, but ``family`` and ``rope_interleave`` (which it has no
    switch for: its one path is the interleaved one)."""
    if not m.rope_interleave:
        raise Unsupported("rope_interleave = False: PaddleFormers' DeepseekV3 always de-interleaves the rope dims "
                          "(apply_rotary_pos_emb reshapes [d/2, 2] -> [2, d/2]); it has no non-interleaved path")
    return {k: v for k, v in m.to_dict().items() if k not in ("family", "rope_interleave")}


def record_routing(model, m: DeepseekV3Config) -> dict:
    """{MoE layer: the router's (top-k indices [T, k], weights [T, k]) as DeepseekV3TopkRouter returns them, filled in
    by the forward}."""
    from harness.runners.paddle.model import record_output

    return {layer: record_output(model.model.layers[layer].mlp.gate)
            for layer in range(m.num_hidden_layers) if hasattr(model.model.layers[layer].mlp, "gate")}


def canonical_modules(m: DeepseekV3Config) -> list[str]:
    """The contract's module paths in forward order (without "module."; the router's two are recorded apart)."""
    names = ["model.embed_tokens"]
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
            "core_attention", "o_proj"]
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}"
        names += [f"{p}.input_layernorm", *(f"{p}.self_attn.{a}" for a in attn), f"{p}.post_attention_layernorm"]
        if layer < m.first_k_dense_replace:
            names += [f"{p}.mlp.gate_up_proj", f"{p}.mlp.act", f"{p}.mlp.down_proj"]
        else:
            names += [f"{p}.mlp.gate.topk_indices", f"{p}.mlp.gate.probs"]
            names += [f"{p}.mlp.experts.{e}" for e in range(m.n_routed_experts)]
            names += [f"{p}.mlp.shared_experts", f"{p}.mlp"]
        names.append(p)
    return [*names, "model.norm"]


def canonical_grads(m: DeepseekV3Config) -> list[str]:
    """The contract's gradient names (without "grad."), gate and up fused: 794 for Kimi-K2's 2-layer shape."""
    names = ["model.embed_tokens.weight"]
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}"
        names += [f"{p}.input_layernorm.weight", *(f"{p}.self_attn.{a}.weight" for a in attn),
                  f"{p}.post_attention_layernorm.weight"]
        if layer < m.first_k_dense_replace:
            names += [f"{p}.mlp.gate_up_proj.weight", f"{p}.mlp.down_proj.weight"]
            continue
        names.append(f"{p}.mlp.gate.weight")
        for e in range(m.n_routed_experts):
            names += [f"{p}.mlp.experts.{e}.gate_up_proj.weight", f"{p}.mlp.experts.{e}.down_proj.weight"]
        names += [f"{p}.mlp.shared_experts.gate_up_proj.weight", f"{p}.mlp.shared_experts.down_proj.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


def explain(error: Exception, request: dict) -> Unsupported | None:
    """UNSUPPORTED, saying why, for what this family cannot run in Paddle: PaddleFormers' MoE in float64."""
    if request["dtype"] == "float64" and _raised_in(error, "deepseek_v3/modeling.py", "moe") \
            and "does not match the type of data" in str(error):
        return Unsupported(
            "PaddleFormers' DeepseekV3MoE.moe cannot run in float64: it accumulates the routed experts into "
            "zeros_like(hidden_states, dtype=topk_weights.dtype), and the router's weights are float32 by "
            "construction (scores.cast(float32)), so index_add_ of the float64 expert outputs into that float32 "
            f"buffer is refused ({str(error).strip().splitlines()[0]}); a float64 case needs dense layers only "
            "(first_k_dense_replace = num_hidden_layers)")
    return None


def _raised_in(error: BaseException, file_suffix: str, function: str) -> bool:
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith(file_suffix) and code.co_name == function:
            return True
        traceback = traceback.tb_next
    return False


def fleet_model(request: dict, phases: Phases) -> dict:
    """PaddleFleet's GPTModel, required on a GPU. Nothing is built unless paddlefleet imports."""
    try:
        import paddlefleet  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR
        failure = import_failure("paddlefleet", error)
        if not isinstance(failure, Unsupported):
            raise failure from error
        raise Unsupported(f"{failure}: on a GPU the Paddle side is PaddleFleet's GPTModel (multi-latent attention, "
                          "MoE, use_accuracy_compatible); install paddlefleet and paddlefleet-ops (Paddle's package "
                          "index) next to paddlepaddle-gpu >= 3.3") from None
    # The construction, as read (files and commits in the module docstring, plus
    # src/paddlefleet/models/gpt/gpt_config.py @ 6ab5862788a71923b445457b759180d29dcf9740 and
    # src/paddlefleet/transformer/transformer_config.py @ d045321053807ddaea2de00dc77e40e5d2039653):
    #   config = GPTConfig(**HF-named fields)  # TransformerConfig takes HF names: hidden_size, num_attention_heads,
    #       # intermediate_size, moe_intermediate_size, n_routed_experts, n_shared_experts, num_experts_per_tok,
    #       # scoring_func, topk_method, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
    #       # rms_norm_eps, rope_theta, rope_scaling (a dict); plus multi_latent_attention=True,
    #       # normalization="RMSNorm", gated_linear_unit=True, hidden_act=F.silu, moe_layer_freq = [0] * dense + [1] *
    #       # moe (a 0/1 list per layer), position_embedding_type="yarn", params_dtype, tensor_model_parallel_size=1,
    #       # parallel_output=False, use_accuracy_compatible (from the case), gpt_model_use_experimental_version
    #   layers = get_gpt_decoder_layers_spec(config, normalization="RMSNorm")
    #   spec = get_gpt_spec(config, layers, mtp_layers_spec=None, vocab_size, max_sequence_length,
    #                       position_embedding_type="yarn", rotary_base=rope_theta, rope_scaling=...,
    #                       parallel_output=False)
    #   model = paddle.distributed.fleet.meta_parallel.build_spec_layer(spec, num_stages=1)
    #   logits = model({"input_ids": ids, "position_ids": positions, "attention_mask": causal})
    # What is missing is a [paddlefleet] section of the name map: GPTModel names its sublayers by position
    # ("model.layers.{i}" through add_sequential_layer), fuses gate and up (up_gate_proj) and may group the experts;
    # those names can only be listed from a built model, which needs a GPU build of paddle and paddlefleet. Until a
    # run on such a machine lists them, a GPU request with paddlefleet present stops here rather than write tensors
    # under names nobody checked.
    raise Unsupported("paddlefleet imports, but the PaddleFleet GPTModel path of paddle_model has not been run "
                      "anywhere yet (written from source only: see harness/families/deepseek_v3/paddle.py); no verdict")
