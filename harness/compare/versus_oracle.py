"""Each framework side's distance from the truth oracle (``harness.runners.oracle``), tensor by tensor.

A DIFF says two sides disagree; this says which of them is closer to the exact result. The oracle is
the reference (side B of ``compare_tensor``), so "max err in ULPs at scale" reads against the exact
tensor's own scale. The oracle reads the shared, unperturbed inputs: on a negative control the
perturbed side is measured against the truth of the inputs it did not get, which is the point.
"""

from __future__ import annotations

from harness.case.checkpoints import load_tensors
from harness.case.registry import Case
from harness.compare.tensors import compare_tensor
from harness.run.orchestrate import SideResult


def versus_oracle(case: Case, pair: list[SideResult], oracle: SideResult | None) -> dict:
    if oracle is None:
        return {}
    if oracle.status != "ok":
        return {"status": oracle.status, "reason": oracle.reason, "sides": {}, "closer": {}}
    try:  # whatever goes wrong here belongs to the oracle section; the verdict stays the frameworks'
        truth = load_tensors(oracle.outputs)
        sides = {}
        for side in pair:
            if side.status != "ok":
                continue
            outputs = load_tensors(side.outputs)
            comparisons = [compare_tensor(spec.name, outputs.get(spec.name), truth[spec.name])
                           for spec in case.output_specs() if spec.name in truth]  # a formula may cover only some
            sides[side.label] = {"runner": side.runner, "tensors": [c.to_dict() for c in comparisons]}
        return {"status": "ok", "reason": "", "sides": sides, "closer": closer_side(sides)}
    except Exception as error:  # noqa: BLE001 - an oracle failure must never become the run's verdict
        return {"status": "error", "reason": f"oracle comparison failed: {type(error).__name__}: {error}",
                "sides": {}, "closer": {}}


def closer_side(sides: dict) -> dict[str, str]:
    """Per tensor, the label of the side nearer the oracle: fewer differing elements, then smaller max error."""
    if len(sides) != 2:
        return {}
    (label_a, a), (label_b, b) = sides.items()
    closer = {}
    for ta, tb in zip(a["tensors"], b["tensors"], strict=True):
        key_a, key_b = (ta["mismatches"], ta["max_abs_error"]), (tb["mismatches"], tb["max_abs_error"])
        closer[ta["name"]] = label_a if key_a < key_b else label_b if key_b < key_a else "tie"
    return closer
