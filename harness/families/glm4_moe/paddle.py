"""GLM-4.5 MoE in Paddle: PaddleFormers' dygraph ``Glm4MoeForCausalLMDeprecated`` (Paddle dygraph, CPU) with its config
from the case's and the knobs that put it on its non-fused paths, the contract's names in the order it writes them,
and the PaddleFleet path (GPU), which stops at UNSUPPORTED. ``harness.runners.paddle.model`` builds, loads and runs it.

PaddleFormers 1.2.0's public ``Glm4MoeForCausalLM`` is a PaddleFleet builder (``__new__`` -> ``GLMMoEModelProvider.
from_config``: "paddlefleet is required for gpt_provider"); its dygraph model is ``Glm4MoeForCausalLMDeprecated``, in
the same module, which imports ``gpt_provider`` at module level. Without PaddleFleet that import needs a stand-in
(``harness.runners.paddle.paddlefleet_shim``, named in meta.json ``adapters``; it changes no computation: the
dygraph model calls none of its names). Measured here (/tmp/zoo-research/FINDINGS.md §3): the dygraph class runs
forward and backward on the CPU in float32; bf16 has no CPU matmul kernel in dygraph; its MoE layer does not run in
float64 (``explain``).
"""

from __future__ import annotations

import os

from harness.families import FamilyConfig as Glm4MoeConfig
from harness.families import family_of
from harness.run.protocol import Phases, Unsupported, import_failure

_FAMILY = family_of('glm4_moe')  # transitional: the family's layout, until this builder moves to its room
gradients, modules, moe_layers, parameters = _FAMILY.gradients, _FAMILY.modules, _FAMILY.moe_layers, _FAMILY.parameters

MODEL = "paddleformers.transformers.glm4_moe.modeling.Glm4MoeForCausalLMDeprecated"
# Its MoE layer on an expert-parallel group (Glm4MoeDecoderLayer: expert_model_parallel_size > 1 and not
# use_unified_moe), a MoEFlexTokenLayer: DeepEP's all-to-all only (harness.runners.paddle.train)
EXPERT_PARALLEL_LAYER = "Glm4MoeFlexMoE"

# PaddleFormers config knobs this runner sets, and why. Everything else comes from the case's HF config keys.
KNOBS = {
    "fuse_rms_norm": (False, "default True calls paddle.incubate fused_rms_norm_ext (a GPU kernel); False takes "
                             "RMSNorm's plain Paddle ops (variance in float32, rsqrt, multiply)"),
    "fuse_swiglu": (False, "the unfused MLP path (silu(gate) * up from up_gate_proj's two halves), as HF computes it"),
    "apply_rope_fusion": (False, "the unfused rotary embedding (rotate_half on the first rotary dims)"),
    "_attn_implementation": ("eager", "eager attention (matmul * scaling, additive causal mask, float32 softmax, "
                                      "matmul), the path HF's eager attention also takes"),
    "use_fused_linear_cross_entropy": (False, "logits are materialised (the contract captures them)"),
    "use_fused_head_and_loss_fn": (False, "lm_head then CrossEntropyLoss, not fused"),
    "use_filtered_label_loss": (False, "CE over all positions, masked by labels != -100 (the contract's mean)"),
    "loss_subbatch_sequence_length": (-1, "no sub-batched loss"),
    "moe_subbatch_token_num_before_dispatch": (0, "no sub-batched MoE recompute"),
    "recompute_granularity": (None, "no recomputation: one forward, hooks see each module once"),
    "num_nextn_predict_layers": (0, "no multi-token-prediction layer (the contract has none; HF has none)"),
    "using_flex_token": (False, "the config default True would pick the flex-token MoE layer (Glm4MoeFlexMoE, expert "
                                "parallel all-to-all); False: Glm4MoeMoE, the per-expert loop at EP=1"),
    "fd_fallback": (False, "routed experts as a LayerList of per-expert MLPs (capturable per expert), not the fused "
                           "3-D GLm4MoeNaiveMoe"),
    "tensor_model_parallel_size": (1, "TP=1: plain paddle.nn.Linear everywhere"),
    "sequence_parallel": (False, "TP=1"),
    "use_cache": (False, "training forward, no KV cache"),
    "attention_dropout": (0.0, "deterministic"),
}


def adapters() -> list[dict]:
    """The adapters this family's model needs here, as meta.json records them: the paddlefleet stand-in (installed
    by ``classes`` around the import) where the real package is missing, with the stand-in names called so far."""
    from harness.runners.paddle import paddlefleet_shim

    return [] if paddlefleet_shim.real_package_present() else [
        {**paddlefleet_shim.ADAPTER, "calls": paddlefleet_shim.calls()}]


def classes():
    """(PaddleFormers' Glm4MoeConfig, Glm4MoeForCausalLMDeprecated), imported when a run asks for them: the
    paddlefleet_ops stand-in first (the runner), then the paddlefleet stand-in around this import only."""
    from harness.runners.paddle import paddlefleet_shim

    with paddlefleet_shim.standing_in():
        from paddleformers.transformers.glm4_moe import configuration, modeling
    return configuration.Glm4MoeConfig, modeling.Glm4MoeForCausalLMDeprecated


def config_kwargs(m: Glm4MoeConfig) -> dict:
    """PaddleFormers' config from the case's: its HF keys (rope_theta and partial_rotary_factor top level, head_dim a
    keyword PaddleFormers keeps as an attribute)."""
    return {k: v for k, v in m.to_dict().items() if k != "family"}


def record_routing(model, m: Glm4MoeConfig) -> dict:
    """{MoE layer: the router's (top-k indices [T, k], weights [T, k]) as Glm4MoeTopkRouter returns them, filled in
    by the forward}."""
    from harness.runners.paddle.model import record_output

    return {layer: record_output(model.model.layers[layer].mlp.gate) for layer in moe_layers(m)}


def canonical_modules(m: Glm4MoeConfig) -> list[str]:
    """The contract's module paths in forward order (without "module."; the router's two are recorded apart)."""
    return [s.name[len("module."):] for s in modules(m, 1)]


def canonical_grads(m: Glm4MoeConfig) -> list[str]:
    """The contract's gradient names (without "grad."), in forward order (the parameters', gate and up fused)."""
    wanted, names = {name[len("grad."):] for name, _ in gradients(m)}, []
    for name, _, _ in parameters(m):
        name = name.replace("gate_proj", "gate_up_proj")
        if name in wanted and name not in names:
            names.append(name)
    return names


def explain(error: Exception, request: dict) -> Unsupported | None:
    """UNSUPPORTED, saying why, for what this family cannot run in Paddle: PaddleFormers' MoE layer in float64."""
    if request["dtype"] == "float64" and _raised_in(error, "glm4_moe/modeling.py", "moe"):
        return Unsupported(
            "PaddleFormers' Glm4MoeMoE.moe cannot run in float64: it accumulates the routed experts into "
            "zeros_like(hidden_states, dtype=topk_weights.dtype), and the router's weights are float32 by "
            "construction (Glm4MoeTopkRouter: a float32 weight, F.linear on x.cast(float32)), so index_add_ of the "
            f"float64 expert outputs into that float32 buffer is refused ({str(error).strip().splitlines()[0]}); a "
            "float64 case needs dense layers only (first_k_dense_replace = num_hidden_layers)")
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
    """PaddleFleet's GLM-4.5 model (PaddleFormers' Glm4MoeForCausalLM -> GLMMoEModelProvider), required on a GPU.
    Nothing is built unless paddlefleet imports, and even then not: that path has not run anywhere yet."""
    try:
        import paddlefleet  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR
        failure = import_failure("paddlefleet", error)
        if not isinstance(failure, Unsupported):
            raise failure from error
        raise Unsupported(f"{failure}: on a GPU the Paddle side of GLM-4.5 is PaddleFormers' Glm4MoeForCausalLM, a "
                          "PaddleFleet builder (GLMMoEModelProvider); install paddlefleet and paddlefleet-ops "
                          "(Paddle's package index) next to paddlepaddle-gpu >= 3.3") from None
    # PaddleFormers 1.2.0 glm4_moe/modeling.py: Glm4MoeForCausalLM.__new__ -> GLMMoEModelProvider.from_config(config)
    # .provide(loss_fn=...) (its dataclass sets rotary_percent 0.5, rotary_base 1e6, moe_router_dtype fp32, expert
    # bias with update rate 0, moe_router_load_balancing_type seq_aux_loss, moe_permute_fusion, apply_rope_fusion);
    # its names would come from _gen_aoa_config. A [paddlefleet] section of names.toml needs a built model to list.
    raise Unsupported("paddlefleet imports, but the PaddleFleet path of paddle_model for glm4_moe has not been run "
                      "anywhere yet (see harness/families/glm4_moe/paddle.py); no verdict")
