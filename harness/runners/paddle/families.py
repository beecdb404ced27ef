"""Every model family in Paddle, from one builder: PaddleFormers' dygraph model of the family (CPU) with its config from
the case's and the knobs that put it on its non-fused paths, the contract's names in the order it writes them, the
routing it records, what it cannot run, and the PaddleFleet path (GPU), which stops at UNSUPPORTED.
``harness.runners.paddle.model`` builds, loads and runs it.

Each block is written once here and driven by the family's architecture (``family.architecture(m)``) and its
``paddle.toml`` (``family.stack("paddle")``: PaddleFormers' classes, knob texts naming them, source citations, the
switches of its quirks). `m` is always the family's typed config (``harness.families.model_config``), resolved once.
The quirks, each named where it is handled: PaddleFormers' missing dygraph model (``no_dygraph_model``: MiniMax-M2),
a model that reads no dense-layer list (``moe_in_every_layer``: Qwen2-MoE), one that has only the interleaved rope
(``interleaved_rope_only``: DeepSeek-V3), a router that returns only its logits (a softmax ``moe.scoring``: the Qwen
blocks; ``record_routing``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
from functools import partial
from pathlib import Path

import numpy as np

from harness.run.protocol import Phases, Unsupported, import_failure

# PaddleFormers config knobs set for every family, and why; a family's paddle.toml [knobs] rewords one where its
# classes differ and adds its own (placed before the TP ones). Everything else comes from the case's HF config keys.
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
}
TP_KNOBS = {
    "tensor_model_parallel_size": (1, "TP=1: plain paddle.nn.Linear everywhere"),
    "sequence_parallel": (False, "TP=1"),
    "use_cache": (False, "training forward, no KV cache"),
    "attention_dropout": (0.0, "deterministic"),
}
RECORD = {  # the routing record's meta.json entry (a softmax router's block: record_routing)
    "name": "routing record (harness/runners/paddle/families.py record_routing)",
    "why": "{block} returns only the router logits: the top-k indices and weights are made again from the logits "
           "mlp.gate produced by the block's own calls (F.softmax float32, paddle.topk, the division by the top-k "
           "sum only with norm_topk_prob, cast to the activations' dtype), under no_grad, and the indices are checked "
           "against the rows every expert was fed",
    "changes_computation": False,
}
EXPERT_PARALLEL_LAYER = "flex-token MoE layer (MoEFlexTokenLayer)"  # where a family names none


def spec(m) -> dict:
    """What this room reads of `m`'s family: its ``paddle.toml``."""
    return m.record.stack("paddle")


def model_name(m) -> str:
    """The class that runs (meta.json ``implementation``)."""
    return spec(m).get("model", spec(m).get("model_class"))


def knobs(m) -> dict[str, tuple]:
    """knob -> (value, why): the common ones, the family's rewording and its own, then the TP ones; none where the
    family has no dygraph model (nothing is built)."""
    if "no_dygraph_model" in spec(m):
        return {}
    own = {name: tuple(entry) for name, entry in spec(m).get("knobs", {}).items()}
    common = {name: own.pop(name, entry) for name, entry in KNOBS.items()}
    return {**common, **own, **TP_KNOBS}


def expert_parallel_layer(m) -> str:
    return spec(m).get("expert_parallel_layer", EXPERT_PARALLEL_LAYER)


def uses_stand_in(m) -> bool:
    """Whether PaddleFormers' dygraph module of `m` imports PaddleFleet names at module level (the stand-in)."""
    return bool(spec(m).get("paddlefleet_stand_in"))


def adapters(m) -> list[dict]:
    """The adapters this family's model needs here, as meta.json records them: the paddlefleet stand-in (installed by
    ``classes`` around the import) where the real package is missing, with the stand-in names called so far, and the
    routing record where the router returns only its logits."""
    from harness.runners.paddle import paddlefleet_shim

    found = []
    if uses_stand_in(m) and not paddlefleet_shim.real_package_present():
        found.append({**paddlefleet_shim.ADAPTER, "calls": paddlefleet_shim.calls()})
    if _recomputes_routing(m):
        block = spec(m)["routing_source"][1].removeprefix("class ")
        found.append({**RECORD, "why": RECORD["why"].format(block=block)})
    return found


def classes(m):
    """(PaddleFormers' config class, its dygraph model class), imported when a run asks for them (the paddlefleet_ops
    stand-in first: the runner), the paddlefleet stand-in around this import only where the family needs it."""
    from harness.runners.paddle import paddlefleet_shim

    if "no_dygraph_model" in spec(m):
        _no_dygraph_model(m)
    if uses_stand_in(m):
        with paddlefleet_shim.standing_in():
            return _load(spec(m)["config_class"]), _load(spec(m)["model_class"])
    return _load(spec(m)["config_class"]), _load(spec(m)["model_class"])


def _load(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def config_kwargs(m) -> dict:
    """PaddleFormers' config from the case's: its HF keys (PaddleFormers reads them by the same names), but ``family``
    and what a quirk of the family says."""
    kwargs = {k: v for k, v in m.to_dict().items() if k != "family"}
    quirk = spec(m).get("interleaved_rope_only")  # DeepSeek-V3: one rope path, no switch for it
    if quirk:
        if not kwargs.pop(quirk):
            raise Unsupported(f"{quirk} = False: PaddleFormers' DeepseekV3 always de-interleaves the rope dims "
                              "(apply_rotary_pos_emb reshapes [d/2, 2] -> [2, d/2]); it has no non-interleaved path")
    layer_class = spec(m).get("moe_in_every_layer")  # Qwen2-MoE: no mlp_only_layers in PaddleFormers
    dense = m.record.dense_layers(m)
    if layer_class and dense:
        if len(dense) < m.num_hidden_layers:
            raise Unsupported(
                f"PaddleFormers 1.2.0's {layer_class} cannot mix dense and MoE layers: it reads neither "
                f"mlp_only_layers nor decoder_sparse_step (every layer is MoE when num_experts > 0); dense layers "
                f"{dense} of {m.num_hidden_layers} asked")
        kwargs["num_experts"] = 0  # every layer its dense MLP: HF's model with these mlp_only_layers
    return kwargs


def canonical_modules(m) -> list[str]:
    """The contract's module paths in forward order (without "module."; the router's two are recorded apart)."""
    return [s.name[len("module."):] for s in m.record.modules(m, 1)]


def canonical_grads(m) -> list[str]:
    """The contract's gradient names (without "grad."), in forward order (the parameters', gate and up fused)."""
    wanted, names = {name[len("grad."):] for name, _ in m.record.gradients(m)}, []
    for name, _, _ in m.record.parameters(m):
        name = name.replace("gate_proj", "gate_up_proj")
        if name in wanted and name not in names:
            names.append(name)
    return names


# --- routing -----------------------------------------------------------------------------------------------------

def _recomputes_routing(m) -> bool:
    """A softmax router's block (the Qwen blocks) returns only the router's logits; a sigmoid one's router
    (``*TopkRouter``) returns its top-k indices and weights."""
    moe = m.record.architecture(m).moe
    return moe is not None and moe.scoring == "softmax"


def record_routing(model, m) -> dict:
    """{MoE layer: {"indices" [T, k], "weights" [T, k]}}, filled in by the forward: the router's own output, or, where
    the block keeps its top-k to itself, made again from the router's logits by the block's calls (``routing_lines``
    of the family's paddle.toml) and checked against the rows each expert was fed (``_check``)."""
    routers = {}
    for layer in m.record.moe_layers(m):
        block = model.model.layers[layer].mlp
        if not _recomputes_routing(m):
            routers[layer] = record_output(block.gate)
            continue
        seen: dict = {}
        block.register_forward_pre_hook(partial(_keep_input, seen, "input"))
        block.gate.register_forward_post_hook(partial(_route, seen, block))
        for e, expert in enumerate(block.experts):
            expert.register_forward_pre_hook(partial(_keep_input, seen, f"fed {e}"))
        block.register_forward_post_hook(partial(_check, seen, layer, len(block.experts), type(block).__name__))
        routers[layer] = seen
    return routers


def record_output(gate) -> dict:
    """A router sublayer's own (indices [T, k], weights [T, k]) output (its first two), copied to the host as it
    leaves forward."""
    seen = {}

    def hook(_layer, _inputs, output):
        seen["indices"], seen["weights"] = (np.array(t.detach().cpu().numpy(), copy=True) for t in output[:2])

    gate.register_forward_post_hook(hook)
    return seen


def _store(seen: dict, key: str, tensor) -> None:
    seen[key] = np.array(tensor.detach().cpu().numpy(), copy=True)


def _keep_input(seen: dict, key: str, _layer, inputs) -> None:
    _store(seen, key, inputs[0])


def _route(seen: dict, block, _gate, inputs, logits) -> None:
    """(A forward post-hook of the block's router) the block's routing from the router's `logits`, by its own calls,
    under no_grad, cast to the router input's dtype (the block's ``hidden_states``)."""
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


def _check(seen: dict, layer: int, experts: int, block: str, _block, _inputs, _output) -> None:
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
                               f"it the rows {block} fed it ({len(tokens)} tokens recorded, "
                               f"{None if fed is None else fed.shape[0]} rows fed): not the model's routing")
    for key in [k for k in seen if k.startswith("fed ") or k == "input"]:
        del seen[key]  # the runner reads indices and weights only


# --- what a family cannot run --------------------------------------------------------------------------------------

def explain(error: Exception, request: dict, m) -> Unsupported | None:
    """UNSUPPORTED, saying why, for what this family cannot run in Paddle: PaddleFormers' MoE layer in float64
    (paddle.toml [float64]: where it is refused, and why)."""
    refusal = spec(m).get("float64")
    if request["dtype"] != "float64" or not refusal or not _raised_in(error, refusal["file"], refusal["function"]):
        return None
    if refusal.get("message", "") not in str(error):
        return None
    return Unsupported(refusal["why"].format(error=str(error).strip().splitlines()[0]))


def _raised_in(error: BaseException, file_suffix: str, function: str) -> bool:
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith(file_suffix) and code.co_name == function:
            return True
        traceback = traceback.tb_next
    return False


def _no_dygraph_model(m) -> None:
    """Quirk (MiniMax-M2): UNSUPPORTED, as PaddleFormers has no dygraph model of the family to run on the CPU; its
    installed module's source is read, not imported (its module-level ``paddlefleet`` import fails without
    PaddleFleet), so a PaddleFormers that adds a dygraph class is reported as such instead."""
    module = spec(m)["no_dygraph_model"]
    version, builders, others = dygraph_classes(module)
    title, provider = spec(m)["fleet"]["title"], spec(m)["fleet"]["provider"]
    if others:
        raise Unsupported(f"PaddleFormers {version} exports {', '.join(others)} in paddleformers/{module}, a class "
                          f"that may be a dygraph {title}; the harness has no builder for it yet "
                          f"(harness/families/{m.family}/paddle.toml)")
    raise Unsupported(
        f"{title} has no dygraph model in PaddleFormers {version}: paddleformers/{module} exports only "
        f"{', '.join(builders) or 'nothing'}, PaddleFleet builders (__new__ -> {provider}, PaddleFleet's model), and "
        "no *Deprecated dygraph class as GLM-4.5 and Qwen3-MoE have; the "
        f"Paddle side of {title} is PaddleFleet's model, on a GPU where paddlefleet imports (not available here)")


def dygraph_classes(module: str) -> tuple[str, list[str], list[str]]:
    """(PaddleFormers' version, the exported classes of its `module` (a path inside the package) that are PaddleFleet
    builders (they define ``__new__``), the exported classes that are not, but the *PreTrainedModel base class that
    both derive from), read from the installed source."""
    found = importlib.util.find_spec("paddleformers")
    if found is None or not found.submodule_search_locations:
        raise import_failure("paddleformers", ModuleNotFoundError("No module named 'paddleformers'"))
    from importlib.metadata import version

    path = Path(list(found.submodule_search_locations)[0]) / module
    if not path.is_file():
        raise Unsupported(f"PaddleFormers {version('paddleformers')} has no paddleformers/{module} (no such family)")
    tree = ast.parse(path.read_text())
    exported = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)), [])
    defined = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    builders, others = [], []
    for name in exported:
        body = defined.get(name)
        if body is None or name.endswith("PreTrainedModel"):
            continue
        is_builder = any(isinstance(n, ast.FunctionDef) and n.name == "__new__" for n in body.body)
        (builders if is_builder else others).append(name)
    return version("paddleformers"), builders, others


def fleet_model(request: dict, phases: Phases, m) -> dict:
    """PaddleFleet's model of the family (PaddleFormers' builder class -> its provider), required on a GPU. Nothing
    is built unless paddlefleet imports, and even then not: that path has not run anywhere yet."""
    fleet = spec(m)["fleet"]
    try:
        import paddlefleet  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR
        failure = import_failure("paddlefleet", error)
        if not isinstance(failure, Unsupported):
            raise failure from error
        why = fleet.get("unsupported") or (
            f"on a GPU the Paddle side of {fleet['title']} is PaddleFormers' {fleet['model']}, a PaddleFleet builder "
            f"({fleet['provider']}); install paddlefleet and paddlefleet-ops (Paddle's package index) next to "
            "paddlepaddle-gpu >= 3.3")
        raise Unsupported(f"{failure}: {why}") from None
    raise Unsupported(fleet.get("not_run") or (
        f"paddlefleet imports, but the PaddleFleet path of paddle_model for {m.family} has not been run anywhere yet "
        f"(see harness/families/{m.family}/paddle.toml); no verdict"))
