"""Re-feed in time (``compare CASE --refeed`` on a training case, docs/training.md): two more runs of side b's stack,
each step starting from side a's state, so every difference at step k is attributed to something step k did or to
what it was handed.

- ``state``: before each step k > 1 side b loads side a's state after step k - 1 (parameters, masters, both moments,
  routing biases) and, at every step, side a's lr; its step counts are its own (it made the same number of steps).
  A quantity that differs here was made by step k itself (its forward/backward, norm, clip or update).
- ``update``: the same, and side a's accumulated gradients of step k in place of side b's, so side b's norm, clip and
  optimizer run on side a's inputs alone: what differs here is made by those formulas, not by the gradients.

Attribution per step and quantity (``attribute``), counting tensors:
- lr: both re-fed runs take side a's lr, so a plain difference is made by the schedule;
- loss, gradients: made by the step's forward/backward where they differ when re-fed, else carried in;
- norm, clip, moments, masters, parameters: made by the optimizer (its norm, clip and Adam together) where they
  differ on side a's gradients too, else made by the step's gradients where they differ re-fed, else carried in
  (with clip_grad = 0 the Adam formula stands alone: the knob that separates it from the norm's);
- routing bias: made by the step (Megatron's update of it) where it differs re-fed, else carried in.
"""

from __future__ import annotations

from pathlib import Path

from harness.case.registry import Case, CaseError
from harness.compare.tensors import EQUAL
from harness.compare.train import compare_steps, quantity_of
from harness.run import orchestrate
from harness.run.orchestrate import SideResult, SideSpec

MODES = ("state", "update")
GRADIENT_MADE = ("loss", "grad")
UPDATE_MADE = ("grad_norm", "clip_coeff", "exp_avg", "exp_avg_sq", "master", "param")


def run(case: Case, checkpoint, pair: list[SideSpec], sides: list[SideResult], plain: list, device: str,
        run_dir: Path, pythons: dict, timeout: float) -> dict:
    """Side b re-fed from side a, in both modes; per step and quantity, what made each difference."""
    train = case.config["train"]
    if train["steps_kept"] != list(range(1, train["steps"] + 1)):
        raise CaseError(f"case {case.name!r}: --refeed needs every step's tensors of side a (train.steps_kept = "
                        f"\"all\"; got {train['steps_kept']})")
    side_a, spec_b = sides[0], pair[1]
    runs, compared = {}, {}
    for mode in MODES:
        config = {**(spec_b.config or {}), "train_refeed": {"mode": mode, "from": str(side_a.folder.resolve())}}
        spec = spec_b._replace(label=f"b.refeed-{mode}", folder=f"b-{spec_b.runner}-refeed-{mode}", config=config)
        result = orchestrate.run_sides(case, [spec], device, run_dir, pythons, timeout)[0]
        runs[mode] = result.to_dict()
        if result.status != "ok":
            return {"status": result.status, "reason": f"re-fed side b ({mode}): {result.reason}", "runs": runs}
        compared[mode], _ = compare_steps(case, [side_a, result])
    return {"status": "ok", "reason": "", "runs": runs, "steps": attribute(plain, compared["state"],
                                                                           compared["update"])}


def attribute(plain: list, state: list, update: list) -> list[dict]:
    """Per step: {quantity: {how: count}} and the tensors made there, from the three comparisons (side a against
    side b plain, re-fed from side a's state, and re-fed with side a's gradients too)."""
    differs = [{c.name for c in comparisons if c.status != EQUAL} for comparisons in (plain, state, update)]
    steps: dict[int, dict] = {}
    for c in plain:
        step = int(c.name.split(".")[0].removeprefix("step"))
        entry = steps.setdefault(step, {"step": step, "counts": {}, "made": {}})
        quantity = quantity_of(c.name)
        how = _how(quantity, *(c.name in d for d in differs))
        entry["counts"].setdefault(quantity, {})
        entry["counts"][quantity][how] = entry["counts"][quantity].get(how, 0) + 1
        if how.startswith("made"):
            entry["made"].setdefault(quantity, []).append(c.name)
    for entry in steps.values():
        entry["made"] = {q: names[:10] for q, names in entry["made"].items()}
        entry["attribution"] = {q: ", ".join(f"{n} {how}" for how, n in sorted(counts.items()))
                                for q, counts in entry["counts"].items() if set(counts) != {"equal"}}
    return [steps[k] for k in sorted(steps)]


def _how(quantity: str, plain: bool, state: bool, update: bool) -> str:
    if not plain:  # the re-fed runs explain the plain run's differences
        return "equal"
    if quantity == "lr":
        return "made by the schedule" if plain else "equal"
    if quantity in GRADIENT_MADE:
        return "made by the step's forward/backward" if state else "carried in"
    if quantity in UPDATE_MADE:
        if update:
            return "made by the optimizer on side a's gradients"
        return "made by the step's gradients" if state else "carried in"
    return "made by the step" if state else "carried in"
