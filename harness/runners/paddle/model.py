"""Paddle whole-model runner (op ``causal_lm``, docs/model-contract.md): a model family's forward, LM loss and backward,
with module outputs and every parameter gradient in canonical names. What is family-specific comes from the Paddle
room's builder of every family (``harness.runners.paddle.families``, reading the family's architecture and
``paddle.toml``): the model classes, their config and knobs, the contract's names in write order, the routing it
records, its own adapters, what it cannot run.

Which implementation runs (written to ``meta.json`` ``implementation``):
- GPU: PaddleFleet's ``GPTModel`` with ``use_accuracy_compatible`` from the case config (the room's
  ``fleet_model``). It needs paddlefleet (and a CUDA build of paddle); where paddlefleet does not import the request is
  UNSUPPORTED (exit 3) and says so, because a GPU verdict is meant to be about PaddleFleet's model.
- CPU: PaddleFormers' model (the family's ``model_class``, Paddle dygraph) on its non-fused paths; every knob set is
  in ``meta.json`` ``knobs`` with why (the room's ``knobs``). PaddleFormers imports the GPU-only ``paddlefleet_ops``
  at import time: a stand-in that only answers "DeepEP not available" is installed when the real package is missing
  (``harness.runners.paddle.paddlefleet_ops_shim``; ``meta.json`` ``adapters``). A family whose dygraph model module
  imports PaddleFleet names at module level (GLM-4.5: ``gpt_provider``) gets them from a names-only ``paddlefleet``
  stand-in during that import (``harness.runners.paddle.paddlefleet_shim``, the room's ``adapters``; named in
  ``implementation`` too). bf16: Paddle's dygraph has no CPU bf16 matmul kernel, so the request is UNSUPPORTED naming
  it.

Weights: the case's HF-named safetensors through the ``[paddle]`` section of the family's ``names.toml`` (Paddle's
linears are ``[in, out]``: transposed; fused q/k/v and gate/up: interleaved, concatenated). Loss: PaddleFormers' own
criterion (``CriterionLayer``, ``sft`` loss): CE of ``logits[t]`` against ``labels[t]`` with no shift (the contract's
labels are already shifted), in float32, summed over ``labels != -100`` and divided by their count. Captures:
``harness.capture.paddle``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from harness.families import model_config
from harness.families.names import NameMap
from harness.run.protocol import OUTPUTS, Phases, Unsupported, import_failure
from harness.runners.paddle import families

try:
    import paddle
except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR (in run)
    paddle = None
    PADDLE_IMPORT_ERROR = error

DTYPES = ("float32", "float64", "bfloat16")


def admit(request: dict) -> dict:
    """What both ops need (one step here, N optimizer steps in ``train``): paddle importable, TP=1, a dtype it runs,
    on the CPU a bf16 matmul kernel where the case is bf16; returns the provenance both write."""
    if paddle is None:
        raise import_failure("paddle", PADDLE_IMPORT_ERROR) from PADDLE_IMPORT_ERROR
    if request["op"] not in ("causal_lm", "causal_lm_train"):
        raise Unsupported(f"only ops causal_lm and causal_lm_train run here (got {request['op']!r})")
    if request.get("tp", 1) != 1:
        raise Unsupported(f"tensor-parallel size 1 only (got tp={request['tp']})")
    if request["dtype"] not in DTYPES:
        raise Unsupported(f"dtype {request['dtype']} is not one of {', '.join(DTYPES)}")
    provenance = {"framework": "paddle", "versions": {"paddlepaddle": paddle.__version__,
                                                      "paddle_commit": paddle.version.commit},
                  "use_accuracy_compatible": request["config"].get("use_accuracy_compatible", True)}
    if request["device"] == "cpu":
        paddle.set_device("cpu")
        if request["dtype"] == "bfloat16":
            _probe_cpu_bf16_matmul()
    return provenance


def run(request: dict, phases: Phases) -> dict:
    provenance = admit(request)
    if request["device"] == "gpu":
        return {**provenance, **families.fleet_model(request, phases, model_config(request["config"]["model"]))}
    return {**provenance, **_paddleformers_model(request, phases)}


# ---------------------------------------------------------------------------------------------------------------
# CPU: PaddleFormers

def _paddleformers_model(request: dict, phases: Phases) -> dict:
    from harness.runners.paddle import paddlefleet_ops_shim

    m = model_config(request["config"]["model"])
    with phases("import"):
        adapter = paddlefleet_ops_shim.install()
        import paddleformers
        families.classes(m)  # the model's module, imported (and timed) here

        from harness.capture.paddle import capture, write
        from harness.capture.rows import first_sequence_only
    dtype = request["dtype"]
    with phases("setup"):
        model, checkpoint, name_map, loaded = build_model(m, dtype, request["checkpoint"])
        # [b, s]: the checkpoint's one sequence, or the case's first in a batch (--versus batch)
        input_ids = paddle.to_tensor(checkpoint["input_ids"].reshape(-1, request["tokens"]))
        labels = paddle.to_tensor(checkpoint["labels"].reshape(-1, request["tokens"]))
        routers = families.record_routing(model, m)
    modules, grads = families.canonical_modules(m), families.canonical_grads(m)
    hooked = [name for name in modules if not name.endswith((".gate.topk_indices", ".gate.probs"))]  # recorded
    refeed_request = request["config"].get("refeed")
    with capture(model, None, name_map=name_map, modules=hooked, grads=grads) as cap:
        refeed = None
        if refeed_request:  # after capture: its hooks see the local tensors
            from harness.capture import EXPERT_WHY, refeed_units
            from harness.capture.paddle import Refeed

            units, not_refed = refeed_units(hooked, lambda n: name_map.rule("modules", n),
                                            extra={"lm_head": ["lm_head"]}, skip={r"\.experts\.\d+$": EXPERT_WHY})
            refeed = Refeed(model, units, refeed_request["mode"], refeed_request.get("from"), batch_dim=0)
        with phases("forward"):
            out = _kernel_guard(lambda: model(input_ids=input_ids, labels=labels, return_dict=True),
                                f"{model.__class__.__name__} forward", request, m)
        with phases("backward"):
            _kernel_guard(lambda: out.loss.backward(), f"{model.__class__.__name__} backward", request, m)
        cap.record("logits", out.logits[0])
        cap.record("loss", out.loss.reshape([]))  # a scalar, as the contract writes it
        refeed_tensors = refeed.finish() if refeed else {}
    with phases("write"):
        tensors, routed = _routing(cap.tensors, routers, m.record.routed_experts(m) if routers else 0)
        batch_blind = first_sequence_only(tensors, input_ids.shape[0], request["tokens"], sequence_first=False)
        upcast = {}
        tensors = {name: _to_case_dtype(name, array, dtype, upcast) for name, array in tensors.items()}
        order = ["module." + x for x in modules] + ["logits", "loss"] + ["grad." + g for g in grads]
        Path(request["output_dir"]).mkdir(parents=True, exist_ok=True)
        write(tensors, os.path.join(request["output_dir"], OUTPUTS), order)
        if refeed:
            from harness.capture import REFEED_FILE
            write(refeed_tensors, os.path.join(request["output_dir"], REFEED_FILE))
    refeed_meta = {"refeed": {**refeed.meta(), "units": list(units),
                              "not_refed": {**_fold_experts(not_refed), **refeed.not_refed}}} if refeed else {}
    family_adapters = families.adapters(m)
    stand_ins = "".join(f"; imported with the {a['name']}" for a in family_adapters)
    return {**refeed_meta,
        "implementation": f"{families.model_name(m)} (Paddle dygraph, CPU, non-fused paths; PaddleFormers' own "
                          f"CriterionLayer sft loss{stand_ins})",
        "versions": {"paddlepaddle": paddle.__version__, "paddle_commit": paddle.version.commit,
                     "paddleformers": getattr(paddleformers, "__version__", "unknown")},
        "adapters": ([adapter] if adapter else []) + family_adapters,
        "paddlefleet_ops": "stand-in (harness)" if adapter else "real package",
        "knobs": {knob: {"value": value, "why": why} for knob, (value, why) in families.knobs(m).items()},
        "name_map": f"{name_map.__class__.__module__}.{name_map.__class__.__name__} [paddle] of "
                    f"{m.record.names.relative_to(Path(__file__).resolve().parents[3])}",
        "weights_loaded": loaded,
        "not_captured": {**cap.not_captured, **_fold_experts(batch_blind)},
        "sequences": input_ids.shape[0],
        "zero_grads": cap.zero_grads,
        "routing": routed,
        "upcast_exactly": upcast,
        "use_accuracy_compatible_note": "read by PaddleFleet only; PaddleFormers has no such switch",
    }


def build_model(m, dtype: str, checkpoint_files: list[str]):
    """The family's PaddleFormers model with its knobs, every weight from the checkpoint, in train mode; (model,
    checkpoint arrays, name map, number of tensors loaded). Also the training runner's (harness.runners.paddle.train).
    `m`: the request's config.model, or typed."""
    from harness.runners.paddle.common import load_checkpoint

    m = model_config(m)
    checkpoint = load_checkpoint(checkpoint_files)
    model = fresh_model(m, dtype)  # its initial weights are all overwritten from the checkpoint
    name_map = NameMap.load(m.family, "paddle", model=m)
    buffers = {name for name, _ in m.record.buffers(m)}
    return model, checkpoint, name_map, _load_weights(model, checkpoint, name_map, buffers)


def fresh_model(m, dtype: str):
    """The family's PaddleFormers model with its knobs, in train mode (dropout is 0: what a training step computes),
    its weights as construction draws them after ``paddle.seed(0)``. `m`: typed config.model."""
    config_class, model_class = families.classes(m)
    config = config_class(**families.config_kwargs(m))
    for knob, (value, _) in families.knobs(m).items():
        setattr(config, knob, value)
    paddle.set_default_dtype(dtype)
    paddle.seed(0)
    model = model_class(config)
    model.train()
    return model


def _fold_experts(names: dict[str, str]) -> dict[str, str]:
    import re
    return {re.sub(r"\.experts\.\d+$", ".experts.{E}", name): why for name, why in names.items()}


def _routing(tensors: dict, routers: dict, experts: int) -> tuple[dict, dict]:
    """topk_indices (each row ascending) and probs [T, E] (the weights at their experts, zero elsewhere): a sort and
    a scatter, exact. Expert outputs are kept only for experts the router chose: PaddleFormers also runs every idle
    expert once on one zero row (a dummy for the gradient graph), which is no output of the model."""
    tensors = dict(tensors)
    summary = {}
    for layer, seen in routers.items():
        p = f"module.model.layers.{layer}.mlp"
        indices, weights = seen["indices"], seen["weights"]
        tensors[f"{p}.gate.topk_indices"] = np.sort(indices, axis=-1).astype(np.int64)
        probs = np.zeros((indices.shape[0], experts), dtype=weights.dtype)
        np.put_along_axis(probs, indices, weights, axis=-1)
        tensors[f"{p}.gate.probs"] = probs
        chosen = set(np.unique(indices).tolist())
        for e in range(experts):
            if e not in chosen:
                tensors.pop(f"{p}.experts.{e}", None)
        summary[f"layer {layer}"] = {"experts_with_tokens": len(chosen)}
    return tensors, summary


LOADS = ("same", "transpose", "cat0", "cat0_transpose", "interleave", "transpose_interleave")


def _load_weights(model, checkpoint: dict, name_map, buffers: set[str]) -> int:
    """Every parameter and the family's `buffers` (the routing bias; Paddle's names are the checkpoint's) from the
    checkpoint through [paddle.checkpoint] (``harness.capture.paddle.apply_rule``: copies only); refuses to run with
    one left out."""
    from harness.capture.paddle import apply_rule

    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if n in buffers})
    for name, target in targets.items():
        rule = name_map.rule("checkpoint", name)
        if rule.kind not in LOADS:
            raise ValueError(f"[paddle.checkpoint] {name}: rule {rule.kind} is not one this runner applies")
        missing = [s for s in rule.sources if s not in checkpoint]
        if missing:
            raise KeyError(f"model tensor {name!r} needs checkpoint tensor(s) {missing} (rule {rule.kind})")
        value = apply_rule(rule, [checkpoint[s] for s in rule.sources])
        if list(value.shape) != list(target.shape):
            raise ValueError(f"{', '.join(rule.sources)} {list(value.shape)} ({rule.kind}) does not fit {name} "
                             f"{list(target.shape)}")
        tensor = paddle.to_tensor(np.ascontiguousarray(value), place=paddle.CPUPlace())
        if tensor.dtype != target.dtype:  # the router weight is a float32 parameter in every case dtype
            tensor = tensor.astype(target.dtype)
        target.set_value(tensor)
    return len(targets)


def _to_case_dtype(name: str, array: np.ndarray, dtype: str, upcast: dict) -> np.ndarray:
    """Outputs in the case dtype where Paddle holds a narrower float (float32 loss and router-weight gradient in a
    float64 run): an exact upcast, listed in meta.json. Indices, probabilities (float32 by contract) and anything that
    would need rounding stay as Paddle held them."""
    if dtype != "float64" or array.dtype != np.float32 or name.endswith(".probs"):
        return array
    upcast[name] = "float32 -> float64 (exact)"
    return array.astype(np.float64)


def _probe_cpu_bf16_matmul() -> None:
    """Ask Paddle's dygraph for its CPU bf16 matmul kernel before building anything."""
    a = paddle.ones([2, 2], dtype="float32").astype("bfloat16")
    try:
        paddle.matmul(a, a)
    except Exception as error:  # Paddle raises a bare NotFoundError/RuntimeError from C++; anything else: ERROR
        first = next((line.strip() for line in str(error).splitlines() if "not registered" in line), "")
        if not first:
            raise
        raise Unsupported("matmul (CPU, bfloat16) not registered: Paddle dygraph has no CPU bf16 matmul kernel, "
                          f"which every linear of the model needs ({first})") from None


def _kernel_guard(call, what: str, request, m):
    """A kernel Paddle lacks here becomes UNSUPPORTED naming it; so does what the room explains for the family `m` (e.g.
    PaddleFormers' DeepSeek-V3 MoE in float64); anything else is a crash."""
    try:
        return call()
    except Exception as error:
        if "not registered" in str(error):
            first = next(line.strip() for line in str(error).splitlines() if "not registered" in line)
            raise Unsupported(f"{what} on {request['device']} in {request['dtype']}: {first}") from error
        unsupported = families.explain(error, request, m)
        if unsupported is not None:
            raise unsupported from error
        raise
