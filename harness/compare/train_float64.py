"""The float64 check of a training case (docs/training.md): every step judged from the same state on both sides.

In float64 every pair of stacks must agree on every state tensor to about 1e-10, bar the floors a stack states in the
name map; beyond it is a mapping error (ERROR naming the step and the tensor), never a DIFF. A plain run starts only
step 1 from the same state: later steps carry the earlier steps' rounding, amplified by the optimizer (Adam most). So
the check reads three comparisons (``parts``):

- the plain run: step 1, every tensor, and the lr of every step (a schedule depends on the step count alone);
- side b re-fed from side a's state (``harness.compare.train_refeed``, mode ``state``): every tensor of steps 2..N;
- side b's optimizer on side a's gradients too (mode ``update``): what the optimizer makes at every step (norm, clip,
  the optimizer's state, masters, parameters), against the ``[<fw>.float64_update]`` floors: no gradient error feeds
  it there, so a wrong lr, weight decay, schedule or update shows at its own scale.
"""

from __future__ import annotations

from harness.case.registry import Case
from harness.compare import model_outputs
from harness.compare.expectation import step_of
from harness.compare.tensors import TensorComparison
from harness.compare.train_refeed import update_made
from harness.compare.train_steps import quantity_of


def parts(plain: list[TensorComparison], refed: dict[str, list] | None) -> list[tuple[str, str, list]]:
    """(what judged them, the floors' table, the comparisons) in the order a reader meets them."""
    judged = [("the plain run", "float64",
               [t for t in plain if step_of(t.name) == 1 or quantity_of(t.name) == "lr"])]
    if refed:
        judged += [("side b re-fed from side a's state", "float64",
                    [t for t in refed["state"] if step_of(t.name) > 1]),
                   ("side b's optimizer on side a's gradients", "float64_update",
                    [t for t in refed["update"] if update_made(quantity_of(t.name))])]
    return judged


def check(case: Case, plain: list[TensorComparison], refed: dict[str, list] | None) -> dict:
    """The semantic check's summary (harness.compare.model.semantic_check's fields) over every part; the first
    mismatch is the earliest step's, and `judged_by` says which part found it. Without `refed` (a run on several
    ranks: the re-feed trains one rank) only step 1 and the lr are judged, and `not_judged` says so."""
    found = []
    for label, table, rows in parts(plain, refed):
        summary = model_outputs.semantic_check(case, rows, case.runners, table=table)
        found.append({"judged_by": label, "table": table, **summary})
    failing = [f for f in found if not f["ok"]]
    first = min(failing, key=lambda f: step_of(f["first_mismatch"])) if failing else None
    merged = {
        "agreement": model_outputs.FLOAT64_AGREEMENT, "ok": first is None,
        "first_mismatch": first and first["first_mismatch"], "first_step": first and step_of(first["first_mismatch"]),
        "judged_by": first and first["judged_by"], "first_module": None,
        "max_relative_error": max((f["max_relative_error"] for f in found), default=0.0),
        "tensors_beyond": first["tensors_beyond"] if first else [],
        "checked": sum(f["checked"] for f in found),
        "floors": {f"{f['judged_by']}: {name}": limit for f in found for name, limit in f["floors"].items()},
        "parts": [{key: f[key] for key in ("judged_by", "table", "checked", "ok", "first_mismatch",
                                           "max_relative_error")} for f in found],
    }
    if refed is None:
        merged["not_judged"] = ("steps 2 on (but their lr): the re-feed that starts them from side a's state "
                                "trains one rank")
    return merged
