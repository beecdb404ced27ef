"""The training level on the comparing side (op ``causal_lm_train``, docs/training.md): two sides' step files read
one step and one tensor pair at a time, compared on raw bits, summarised along time. Returns data only;
harness/report/train_section.py renders it.

- ``compare_steps``: every canonical tensor of every step: kept steps compared element by element
  (``compare_tensor``), the others by digest (equal or not; two digests of different algorithms are UNCOMPARABLE,
  an ERROR: harness.run.steps says where each algorithm is used); per step the scalars (equal, or how far apart), "k of
  794" per state quantity, and the step's first differing output; over the run the first divergence in time (the
  first step, and in it the first quantity in the step's order: lr, loss, gradients, norm, clip, the optimizer's
  state, masters, parameters, then the routing biases the next step reads); with the truth, per step and quantity
  which side is closer.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack

import numpy as np
from safetensors import safe_open

from harness.bits import format_of
from harness.case.ops import state_quantities, step_quantities, train_step_outputs
from harness.case.registry import Case
from harness.case.specs import resolve_dtype
from harness.compare.model_outputs import TRUTH_RUNNER, _numpy_dtype
from harness.compare.tensors import DIFF, DTYPE_MISMATCH, EQUAL, SHAPE_MISMATCH, TensorComparison, compare_tensor
from harness.run.orchestrate import SideResult
from harness.run.steps import DIGEST, DOUBLES, algorithm_of, digest_as, read_header, step_file
from harness.runners.oracle.runner import round_once

SCALARS = ("lr", "loss", "grad_norm", "clip_coeff")
UNCOMPARABLE = "UNCOMPARABLE"  # two digests of one tensor made with different algorithms: an ERROR, never a verdict


def quantity_of(name: str) -> str:
    """step3.exp_avg.model.norm.weight -> exp_avg; step3.lr -> lr."""
    return name.split(".")[1]


def compare_steps(case: Case, pair: list[SideResult], truth: SideResult | None = None,
                  unreliable: set[int] = frozenset()) -> tuple[list, dict]:
    """(every comparison in time order, the summary along time); no side is compared with the truth at the steps
    in `unreliable` (harness.compare.train_truth.check_truth)."""
    comparisons, steps = [], []
    for step in range(1, case.train.steps + 1):
        rows, summary = compare_one_step(case, step, pair)
        if truth is not None and truth.status == "ok" and step not in unreliable:
            summary["truth"] = versus_truth(case, step, pair, truth)
        comparisons += rows
        steps.append(summary)
    return comparisons, summarise(case, steps, truth)


def compare_one_step(case: Case, step: int, pair: list[SideResult]) -> tuple[list[TensorComparison], dict]:
    """One step of the pair: its comparisons and its summary, without the truth (``versus_truth`` adds it)."""
    specs = train_step_outputs(case.config["model"], case.train, step)
    rows = _compare_step(step, specs, pair)
    return rows, _summarise_step(step, specs, rows, pair, case)


def versus_truth(case: Case, step: int, pair: list[SideResult], truth: SideResult) -> dict:
    """A step's summary entry ``truth``: per quantity, which side is closer to the truth's step."""
    return _versus_truth(step, train_step_outputs(case.config["model"], case.train, step), pair, truth, case)


def summarise(case: Case, steps: list[dict], truth: SideResult | None) -> dict:
    """The summary along time of the steps' summaries (``compare_steps``)."""
    train, m = case.train, case.config["model"]
    first = next((s for s in steps if s["first_divergence"]), None)
    parameters = sum(1 for s in train_step_outputs(m, train, 1) if quantity_of(s.name) == "param")
    return {
        "steps": steps, "parameters": parameters, "steps_kept": list(train.steps_kept),
        "first_divergence": ({"step": first["step"], "quantity": quantity_of(first["first_divergence"]),
                              "tensor": first["first_divergence"]} if first else None),
        "order": list(step_quantities(train.record)), "truth": _truth_status(truth),
    }


def invariance(summary: dict) -> dict:
    """Comparing one stack at two rank counts: the quantities bitwise equal at every step ("bitwise") and, for each
    other, the first step it differs at ("departs"), in the step's order."""
    departs = {}
    for step in summary["steps"]:
        differing = [q for q, scalar in step["scalars"].items() if scalar["equal"] is False]
        differing += [q for q, counts in step["quantities"].items() if counts["equal"] < counts["total"]]
        for quantity in differing:
            departs.setdefault(quantity, step["step"])
    present = [q for q in summary["order"] if any(q in step["scalars"] or q in step["quantities"]
                                                  for step in summary["steps"])]
    return {"bitwise": [q for q in present if q not in departs],
            "departs": {q: departs[q] for q in present if q in departs}}


def compare_step(case: Case, step: int, pair: list[SideResult]) -> list[TensorComparison]:
    """One step's comparisons of two sides (a re-feed's check against a plain run)."""
    return _compare_step(step, train_step_outputs(case.config["model"], case.train, step), pair)


def _open(path, stack):
    return stack.enter_context(safe_open(str(path), framework="numpy"))


def _compare_step(step: int, specs, pair: list[SideResult]) -> list[TensorComparison]:
    files = [step_file(side.folder, step) for side in pair]
    headers = [read_header(path) for path in files]
    rows = []
    with ExitStack() as stack:
        handles = [_open(path, stack) for path in files]
        for spec in specs:
            held = [spec.name in header.layouts for header in headers]
            if spec.optional and not all(held):  # a scalar a stack does not compute (a norm without clipping)
                continue
            if all(held):
                rows.append(compare_tensor(spec.name, handles[0].get_tensor(spec.name),
                                           handles[1].get_tensor(spec.name)))
                continue
            made = [header.digests.get(spec.name) for header in headers]
            if all(made) and len({algorithm_of(d) for d in made}) > 1:
                rows.append(TensorComparison(spec.name, UNCOMPARABLE, note=(
                    f"side a digested it with {algorithm_of(made[0])}, side b with {algorithm_of(made[1])}: digests "
                    "of two algorithms say nothing of equal bits (sides run on different devices?); keep the step "
                    "(--steps-kept) to compare its tensors")))
                continue
            algorithm = algorithm_of(next(d for d in made if d)) if any(made) else DIGEST
            # a kept tensor against the other side's digest: digested here in that side's algorithm
            digests = [value or (digest_as(algorithm, h.get_tensor(spec.name)) if spec.name in header.layouts
                                 else None) for value, header, h in zip(made, headers, handles, strict=True)]
            if None in digests:
                rows.append(TensorComparison(spec.name, "MISSING", note="a side holds neither the tensor nor its "
                                                                         "digest"))
                continue
            rows.append(_by_digest(spec, digests, [header.layouts.get(spec.name) or header.digest_layouts.get(
                spec.name) for header in headers]))
    return rows


def _by_digest(spec, digests: list[str], layouts: list) -> TensorComparison:
    """Two digests of one tensor: equal only when the dtypes and shapes they were made of are too."""
    (dtype_a, shape_a), (dtype_b, shape_b) = (layout or (None, None) for layout in layouts)
    if dtype_a != dtype_b:
        return TensorComparison(spec.name, DTYPE_MISMATCH, note=f"dtype {dtype_a} vs {dtype_b} (compared by digest)")
    if list(shape_a or []) != list(shape_b or []):
        return TensorComparison(spec.name, SHAPE_MISMATCH, dtype=dtype_a,
                                note=f"shape {list(shape_a)} vs {list(shape_b)} (compared by digest)")
    return TensorComparison(spec.name, EQUAL if digests[0] == digests[1] else DIFF, shape=list(spec.shape),
                            note="compared by digest (step not kept)", digests=list(digests))


def _summarise_step(step: int, specs, rows: list[TensorComparison], pair, case: Case) -> dict:
    by_name = {row.name: row for row in rows}
    quantities = {}
    for quantity in (*state_quantities(case.train.record), "expert_bias"):
        members = [row for row in rows if quantity_of(row.name) == quantity]
        if members:
            differing = [row.name for row in members if row.status != EQUAL]
            quantities[quantity] = {"equal": len(members) - len(differing), "total": len(members),
                                    "differing": differing[:20]}
    first = next((row.name for row in rows if row.status != EQUAL), None)
    return {"step": step, "verdict": "BITWISE_PASS" if first is None else "DIFF", "first_divergence": first,
               "kept": step in case.train.steps_kept,
               "scalars": _scalars(step, specs, pair, by_name), "quantities": quantities}


def _scalars(step: int, specs, pair, by_name: dict) -> dict:
    """Per scalar of the step: each side's value (and the double it came from, where a stack holds one), equal or
    how far apart in ULPs of the dtype it is compared in; a scalar a side did not compute: which side, no verdict."""
    out = {}
    with ExitStack() as stack:
        handles = [_open(step_file(side.folder, step), stack) for side in pair]
        doubles = [json.loads((h.metadata() or {}).get(DOUBLES, "{}")) for h in handles]
        for spec in specs:
            name = spec.name
            scalar = quantity_of(name)
            if scalar not in SCALARS:
                continue
            held = [name in h.keys() for h in handles]
            if not all(held):
                missing = [f"{side.label} ({side.runner})" for side, has in zip(pair, held, strict=True) if not has]
                out[scalar] = {"a": None, "b": None, "equal": None, "ulps": None, "unit": "",
                               "note": f"not computed by side {' and '.join(missing)}"}
                continue
            values = [h.get_tensor(name) for h in handles]
            unit = str(values[1].dtype)
            out[scalar] = {"a": values[0].astype(np.float64).tolist(), "b": values[1].astype(np.float64).tolist(),
                           "equal": by_name[name].status == EQUAL, "ulps": ulps_apart(values[0], values[1], unit),
                           "unit": f"{unit} ULP"}
            for label, held_doubles in zip("ab", doubles, strict=True):
                if name in held_doubles:
                    out[scalar][f"{label}_double"] = held_doubles[name]
    return out


def ulps_apart(a: np.ndarray, b: np.ndarray, unit: str) -> float:
    """The largest |a - b| over the spacing of `unit` at |b|, in ULPs of `unit` (the dtype the scalar is compared in;
    inf where a value is not finite)."""
    fmt = format_of(unit)
    worst = 0.0
    for x, y in zip(np.ravel(a), np.ravel(b), strict=True):
        if x == y:
            continue
        spacing = float(np.spacing(np.abs(np.asarray(y, dtype=fmt.float_dtype))))
        worst = max(worst, abs(float(x) - float(y)) / spacing if spacing else math.inf)
    return worst


def _versus_truth(step: int, specs, pair, truth: SideResult, case: Case) -> dict:
    """Per quantity, how many tensors each side is closer to the truth on (fewer differing elements from the truth
    rounded once to the tensor's dtype, then the smaller max error); per scalar the closer side."""
    files = [step_file(side.folder, step) for side in (*pair, truth)]
    headers = [read_header(path) for path in files]
    counts: dict[str, dict[str, int]] = {}
    with ExitStack() as stack:
        handles = [_open(path, stack) for path in files]
        for spec in specs:
            quantity = quantity_of(spec.name)
            source = spec.name.replace(".master.", ".param.", 1)  # the truth has no masters: its parameter is one
            if not all(spec.name in h.layouts for h in headers[:2]) or source not in headers[2].layouts:
                continue
            exact = handles[2].get_tensor(source).astype(np.float64)
            dtype = np.dtype(_numpy_dtype(resolve_dtype(spec.dtype, case.dtype)))
            reference = round_once(exact, dtype) if dtype != np.float64 else exact
            keys = [distance(handle.get_tensor(spec.name), reference) for handle in handles[:2]]
            closer = "a" if keys[0] < keys[1] else "b" if keys[1] < keys[0] else "tie"
            tally = counts.setdefault(quantity, {"a": 0, "b": 0, "tie": 0})
            tally[closer] += 1
    return counts


def distance(value: np.ndarray, reference: np.ndarray) -> tuple[int, float]:
    """(elements whose bits differ, the largest absolute difference in float64): the two numbers that say which side
    is closer to the truth (versus_oracle.closer_side's order), without compare_tensor's ULP statistics."""
    differ = np.ascontiguousarray(value).view(np.uint8).reshape(value.size, -1) != \
        np.ascontiguousarray(reference).view(np.uint8).reshape(reference.size, -1)
    differ = differ.any(axis=1) if differ.ndim == 2 else differ
    count = int(np.count_nonzero(differ))
    if not count:
        return 0, 0.0
    flat_a, flat_b = value.reshape(-1)[differ], reference.reshape(-1)[differ]
    with np.errstate(invalid="ignore"):
        return count, float(np.nanmax(np.abs(flat_a.astype(np.float64) - flat_b.astype(np.float64)), initial=0.0))


def _truth_status(truth: SideResult | None) -> dict:
    if truth is None:
        return {}
    return {"runner": truth.runner, "status": truth.status, "reason": truth.reason, "python": truth.python,
            "what": f"{TRUTH_RUNNER} trained in float64 (float64 mode, no masters), rounded once to each tensor's "
                    "dtype"}
