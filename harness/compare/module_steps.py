"""The first divergent module inside a step of two captured runs (docs/attach.md, ``modules_at``): where both runs
wrote ``modules/step{k:05d}.safetensors`` (``harness.attach.modules``: each micro-batch's module outputs and output
gradients in canonical names), each compared bit for bit (``harness.compare.tensors``) in the order the step makes
them (micro-batch; the outputs in the family's module order, ``Family.modules``; then the gradients in reverse),
and, where the truth run captured the step too, which run the float64 truth sides with at the first divergent module
(the smaller largest distance from it).

Fails closed: two runs that captured the same step but not the same module outputs (names, shapes) are an ERROR
naming the first one; a step captured by one run only is a note.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from harness.capture import GRAD, MODULE_ORDER, MODULES_DIR, module_file
from harness.compare.captured_runs import CapturedRun, RunError
from harness.compare.tensors import EQUAL, TensorComparison, compare_tensor
from harness.families import family_of, model_config
from harness.families.own import OWN

STEP = re.compile(r"step(\d+)\.safetensors")


def captured_steps(run: CapturedRun) -> set[int]:
    folder = run.folder / MODULES_DIR
    if not folder.is_dir():
        return set()
    return {int(match.group(1)) for path in folder.iterdir() if (match := STEP.fullmatch(path.name))}


def compare(a: CapturedRun, b: CapturedRun, truth: CapturedRun | None, count: int,
            ) -> tuple[list[TensorComparison], dict | None, list[str]]:
    """(one row per module output of every step both runs captured up to `count`, the summary for the report, notes).
    The summary: the steps compared and, at the first step where a module differs, the first module (its name,
    micro-batch, row) and which run the truth sides with (where it captured that step)."""
    mine, theirs = captured_steps(a), captured_steps(b)
    notes = [f"module outputs captured by run {label} only at steps {', '.join(map(str, sorted(only)))}: not compared"
             for label, only in (("A", {s for s in mine - theirs if s <= count}),
                                 ("B", {s for s in theirs - mine if s <= count})) if only]
    steps = sorted(s for s in mine & theirs if s <= count)
    if not steps:
        return [], None, notes
    rows, first = [], None
    for step in steps:
        tensors = [_load(run, step) for run in (a, b)]
        order = _order(a, step)
        names = sorted(tensors[0], key=order)
        if set(tensors[0]) != set(tensors[1]):
            other = next(n for n in sorted({*tensors[0], *tensors[1]}, key=order)
                         if n not in tensors[0] or n not in tensors[1])
            held = "A" if other in tensors[0] else "B"
            raise RunError(f"step {step}'s module outputs are not the same in both runs: {other!r} is in run {held}'s "
                           f"{module_file(a.folder if held == 'A' else b.folder, step)} only")
        for name in names:
            row = compare_tensor(f"step{step}.module.{name}", tensors[0][name], tensors[1][name])
            rows.append(row)
            if first is None and row.status != EQUAL:
                micro_batch, _, held = name.partition(".")
                quantity = "output gradient" if held.startswith(GRAD) else "output"
                first = {"step": step, "module": held.removeprefix(GRAD).removeprefix("module."),
                         "quantity": quantity, "micro_batch": int(micro_batch[2:]), "tensor": row.name,
                         "truth": _sides_with(truth, step, name, tensors)}
    return rows, {"steps": steps, "first_divergence": first}, notes


def _order(run: CapturedRun, step: int):
    """Sort key of ``mb{i}.module.<name>`` and ``mb{i}.refeed.grad_output.<name>``: the micro-batch, then the outputs
    in the family's forward order of modules (a model of its own: the order its forward reached them, as the module
    file's metadata says), then the gradients in the backward's (the reverse)."""
    m = model_config(run.model)
    if m.family == OWN:
        position = {name: i for i, name in enumerate(_forward_order(run, step))}
    else:
        position = {spec.name.removeprefix("module."): i for i, spec in enumerate(family_of(m.family).modules(m, 1))}

    def key(name: str) -> tuple:
        micro_batch, _, held = name.partition(".")
        gradient = held.startswith(GRAD)
        module = held.removeprefix(GRAD).removeprefix("module.")
        at = position.get(module, len(position))
        return int(micro_batch[2:]), gradient, -at if gradient else at, module
    return key


def _forward_order(run: CapturedRun, step: int) -> list[str]:
    """A model of its own's modules in the order its forward reached them (``harness.capture.MODULE_ORDER``)."""
    path = module_file(run.folder, step)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            order = json.loads((handle.metadata() or {})[MODULE_ORDER])
    except (OSError, ValueError, KeyError) as error:
        raise RunError(f"{path}: no readable module order in its metadata ({type(error).__name__}: {error}): a "
                       "model of its own's modules are compared in the order its forward ran them") from None
    if not isinstance(order, list) or not all(isinstance(name, str) for name in order):
        raise RunError(f"{path}: metadata {MODULE_ORDER!r} must be a list of module names (got {order!r})")
    return order


def _load(run: CapturedRun, step: int) -> dict[str, np.ndarray]:
    path = module_file(run.folder, step)
    try:
        return load_file(str(path))
    except (OSError, ValueError) as error:
        raise RunError(f"{path}: not a readable safetensors file: {error}") from None


def _sides_with(truth: CapturedRun | None, step: int, name: str, tensors: list[dict]) -> dict | None:
    """Which run is closer to the truth's output of the module (largest absolute distance, in float64): "A", "B" or
    "neither" (as close), with both distances; None where the truth did not capture it."""
    if truth is None or step not in captured_steps(truth):
        return None
    reference = _load(truth, step).get(name)
    if reference is None or reference.shape != tensors[0][name].shape:
        return None
    distances = [float(np.max(np.abs(t[name].astype(np.float64) - reference.astype(np.float64)))) for t in tensors]
    side = "neither" if distances[0] == distances[1] else "A" if distances[0] < distances[1] else "B"
    return {"side": side, "distance_a": distances[0], "distance_b": distances[1], "file": str(Path(truth.folder))}
