"""Qwen3-MoE in Paddle: PaddleFormers' dygraph ``Qwen3MoeForCausalLMDeprecated`` (Paddle dygraph, CPU) with its config
from the case's and the knobs that put it on its non-fused paths, the contract's names in the order it writes them,
its routing, and the PaddleFleet path (GPU), which stops at UNSUPPORTED. ``harness.runners.paddle.model`` builds,
loads and runs it.

PaddleFormers 1.2.0's public ``Qwen3MoeForCausalLM`` is a PaddleFleet builder (``Qwen3MoEModelProvider``, a
``GPTModelProvider``: "paddlefleet is required for gpt_provider"); its dygraph model is
``Qwen3MoeForCausalLMDeprecated``, in the same module, which imports ``gpt_provider`` at module level (line 45).
Without PaddleFleet that import needs a stand-in (``harness.runners.paddle.paddlefleet_shim``, named in meta.json
``adapters``; it changes no computation: the dygraph model calls none of its names), as for GLM-4.5. Measured here
(/tmp/zoo-research/FINDINGS.md §3): the dygraph class runs forward and backward on the CPU in float32; bf16 has no CPU
matmul kernel in dygraph; its MoE layer does not run in float64 (``explain``).

Routing: ``Qwen3MoeSparseMoeBlock.forward`` returns (output, router logits) and keeps the top-k it makes from the
logits to itself (``F.softmax(router_logits, axis=1, dtype=paddle.float32)``, ``paddle.topk``, the division by the
top-k sum, ``.to(hidden_states.dtype)``). ``record_routing`` makes them again from the logits ``mlp.gate`` produced,
by those same calls (``ROUTING``: the source lines they follow, which tests/test_qwen3_moe.py finds in PaddleFormers'
source), and checks the indices against the model itself: the rows each expert was fed must be the block's input at
the tokens the indices send to it, in the block's (top-k slot, token) order (an idle expert: one zero row, the
block's dummy call in training). A mismatch stops the run (ERROR); it never writes a routing the model did not use.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np

from harness.families import FamilyConfig as Qwen3MoeConfig
from harness.families import family_of
from harness.run.protocol import Phases, Unsupported, import_failure

_FAMILY = family_of('qwen3_moe')  # transitional: the family's layout, until this builder moves to its room
gradients, modules, moe_layers, parameters = _FAMILY.gradients, _FAMILY.modules, _FAMILY.moe_layers, _FAMILY.parameters

MODEL = "paddleformers.transformers.qwen3_moe.modeling.Qwen3MoeForCausalLMDeprecated"

# PaddleFormers config knobs this runner sets, and why. Everything else comes from the case's HF config keys.
KNOBS = {
    "fuse_rms_norm": (False, "default True calls paddle.incubate fused_rms_norm_ext (a GPU kernel); False takes "
                             "RMSNorm's plain Paddle ops (variance in float32, rsqrt, multiply)"),
    "fuse_swiglu": (False, "the unfused MLP path (silu(gate) * up from up_gate_proj's two halves), as HF computes it"),
    "apply_rope_fusion": (False, "the unfused rotary embedding (rotate_half)"),
    "_attn_implementation": ("eager", "eager attention (matmul * scaling, additive causal mask, float32 softmax, "
                                      "matmul), the path HF's eager attention also takes"),
    "use_fused_linear_cross_entropy": (False, "logits are materialised (the contract captures them)"),
    "use_fused_head_and_loss_fn": (False, "lm_head then CrossEntropyLoss, not fused"),
    "use_filtered_label_loss": (False, "CE over all positions, masked by labels != -100 (the contract's mean)"),
    "loss_subbatch_sequence_length": (-1, "no sub-batched loss"),
    "moe_subbatch_token_num_before_dispatch": (0, "no sub-batched MoE recompute"),
    "recompute_granularity": (None, "no recomputation: one forward, hooks see each module once"),
    "output_router_logits": (False, "no load-balancing loss added to the LM loss (the real config's value)"),
    "fd_fallback": (False, "routed experts as a LayerList of per-expert MLPs (Qwen3MoeSparseMoeBlock's loop), not "
                           "the fused 3-D Qwen3MoeExperts"),
    "tensor_model_parallel_size": (1, "TP=1: plain paddle.nn.Linear everywhere"),
    "sequence_parallel": (False, "TP=1"),
    "use_cache": (False, "training forward, no KV cache"),
    "attention_dropout": (0.0, "deterministic"),
}

# The lines of PaddleFormers 1.2.0's Qwen3MoeSparseMoeBlock.forward that make the routing; record_routing makes it by
# the same calls (tests/test_qwen3_moe.py finds each line in the installed source).
ROUTING = (
    "router_logits = self.gate(hidden_states)",
    "routing_weights = F.softmax(router_logits, axis=1, dtype=paddle.float32)",
    "routing_weights, selected_experts = paddle.topk(routing_weights, self.top_k, axis=-1)",
    "routing_weights /= routing_weights.sum(axis=-1, keepdim=True)",
    "routing_weights = routing_weights.to(hidden_states.dtype)",
    "top_x, idx = paddle.where(expert_mask[expert_idx])",
)
RECORD = {
    "name": "routing record (harness/families/qwen3_moe/paddle.py record_routing)",
    "why": "Qwen3MoeSparseMoeBlock returns only the router logits: the top-k indices and weights are made again from "
           "the logits mlp.gate produced by the block's own calls (F.softmax float32, paddle.topk, division by the "
           "top-k sum, cast to the activations' dtype), under no_grad, and the indices are checked against the rows "
           "every expert was fed",
    "changes_computation": False,
}


def adapters() -> list[dict]:
    """The adapters this family's model needs here, as meta.json records them: the paddlefleet stand-in (installed
    by ``classes`` around the import) where the real package is missing, with the stand-in names called so far, and
    the routing record."""
    from harness.runners.paddle import paddlefleet_shim

    stand_in = [] if paddlefleet_shim.real_package_present() else [
        {**paddlefleet_shim.ADAPTER, "calls": paddlefleet_shim.calls()}]
    return [*stand_in, RECORD]


def classes():
    """(PaddleFormers' Qwen3MoeConfig, Qwen3MoeForCausalLMDeprecated), imported when a run asks for them: the
    paddlefleet_ops stand-in first (the runner), then the paddlefleet stand-in around this import only."""
    from harness.runners.paddle import paddlefleet_shim

    with paddlefleet_shim.standing_in():
        from paddleformers.transformers.qwen3_moe import configuration, modeling
    return configuration.Qwen3MoeConfig, modeling.Qwen3MoeForCausalLMDeprecated


def config_kwargs(m: Qwen3MoeConfig) -> dict:
    """PaddleFormers' config from the case's: its HF keys (rope_theta top level, head_dim a keyword PaddleFormers
    keeps as an attribute, mlp_only_layers a list)."""
    return {k: v for k, v in m.to_dict().items() if k != "family"}


def record_routing(model, m: Qwen3MoeConfig) -> dict:
    """{MoE layer: {"indices" [T, k], "weights" [T, k]}} as Qwen3MoeSparseMoeBlock makes them from its router's
    logits (module docstring), filled in by the forward and checked against the rows each expert was fed."""
    routers = {}
    for layer in moe_layers(m):
        block = model.model.layers[layer].mlp
        seen: dict = {}
        block.register_forward_pre_hook(partial(_keep_input, seen, "input"))
        block.gate.register_forward_post_hook(partial(_route, seen, block))
        for e, expert in enumerate(block.experts):
            expert.register_forward_pre_hook(partial(_keep_input, seen, f"fed {e}"))
        block.register_forward_post_hook(partial(_check, seen, layer, len(block.experts)))
        routers[layer] = seen
    return routers


def _store(seen: dict, key: str, tensor) -> None:
    seen[key] = np.array(tensor.detach().cpu().numpy(), copy=True)


def _keep_input(seen: dict, key: str, _layer, inputs) -> None:
    _store(seen, key, inputs[0])


def _route(seen: dict, block, _gate, inputs, logits) -> None:
    """(A forward post-hook of the block's router) the block's routing from the router's `logits`, by its own calls
    (``ROUTING``), under no_grad, cast to the router input's dtype (the block's ``hidden_states``)."""
    import paddle
    import paddle.nn.functional as F

    with paddle.no_grad():
        weights = F.softmax(logits, axis=1, dtype=paddle.float32)
        weights, indices = paddle.topk(weights, block.top_k, axis=-1)
        if block.norm_topk_prob:
            weights /= weights.sum(axis=-1, keepdim=True)
        weights = weights.to(inputs[0].dtype)
    _store(seen, "weights", weights)
    _store(seen, "indices", indices)


def _check(seen: dict, layer: int, experts: int, _block, _inputs, _output) -> None:
    """Every expert was fed exactly the block's input rows at the tokens the recorded indices send to it, in the
    block's (top-k slot, token) order (``paddle.where`` over the [top-k, tokens] mask); an expert with none, one zero
    row or nothing. Else the recorded routing is not the model's: stop."""
    hidden = seen["input"].reshape(-1, seen["input"].shape[-1])
    indices = seen["indices"]
    for e in range(experts):
        fed = seen.get(f"fed {e}")
        slots, tokens = np.nonzero((indices == e).T)  # (slot, token) order, as paddle.where over [k, T]
        if len(tokens):
            ok = fed is not None and fed.shape == (len(tokens), hidden.shape[-1]) and np.array_equal(
                fed.view(np.uint8), hidden[tokens].view(np.uint8))
        else:
            ok = fed is None or (fed.shape[0] == 1 and not fed.any())
        if not ok:
            raise RuntimeError(f"layer {layer} expert {e}: the routing recorded from mlp.gate's logits does not send "
                               f"it the rows Qwen3MoeSparseMoeBlock fed it ({len(tokens)} tokens recorded, "
                               f"{None if fed is None else fed.shape[0]} rows fed): not the model's routing")
    for key in [k for k in seen if k.startswith("fed ") or k == "input"]:
        del seen[key]  # the runner reads indices and weights only


def canonical_modules(m: Qwen3MoeConfig) -> list[str]:
    """The contract's module paths in forward order (without "module."; the router's two are recorded apart)."""
    return [s.name[len("module."):] for s in modules(m, 1)]


def canonical_grads(m: Qwen3MoeConfig) -> list[str]:
    """The contract's gradient names (without "grad."), in forward order (the parameters', gate and up fused)."""
    wanted, names = {name[len("grad."):] for name, _ in gradients(m)}, []
    for name, _, _ in parameters(m):
        name = name.replace("gate_proj", "gate_up_proj")
        if name in wanted and name not in names:
            names.append(name)
    return names


def explain(error: Exception, request: dict) -> Unsupported | None:
    """UNSUPPORTED, saying why, for what this family cannot run in Paddle: PaddleFormers' MoE layer in float64."""
    if request["dtype"] == "float64" and _raised_in(error, "qwen3_moe/modeling.py", "forward"):
        return Unsupported(
            "PaddleFormers' Qwen3MoeSparseMoeBlock cannot run in float64: its router (mlp.gate) is a float32 "
            "GeneralLinear made under dtype_guard('float32'), and the float64 activations cannot enter it "
            f"({str(error).strip().splitlines()[0]}); a float64 case needs dense layers only (mlp_only_layers = "
            "every layer)")
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
    """PaddleFleet's Qwen3-MoE model (PaddleFormers' Qwen3MoeForCausalLM -> Qwen3MoEModelProvider), required on a
    GPU. Nothing is built unless paddlefleet imports, and even then not: that path has not run anywhere yet."""
    try:
        import paddlefleet  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR
        failure = import_failure("paddlefleet", error)
        if not isinstance(failure, Unsupported):
            raise failure from error
        raise Unsupported(f"{failure}: on a GPU the Paddle side of Qwen3-MoE is PaddleFormers' Qwen3MoeForCausalLM, "
                          "a PaddleFleet builder (Qwen3MoEModelProvider); install paddlefleet and paddlefleet-ops "
                          "(Paddle's package index) next to paddlepaddle-gpu >= 3.3") from None
    raise Unsupported("paddlefleet imports, but the PaddleFleet path of paddle_model for qwen3_moe has not been run "
                      "anywhere yet (see harness/families/qwen3_moe/paddle.py); no verdict")
