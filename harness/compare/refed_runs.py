"""``compare-runs RUN_A RUN_B --refed RUN_B_REFED``: which differences between two of the users' runs step k + 1 made
and which it carried in, as the built-in re-feed in time says for the harness's own runs
(``harness.compare.train_refeed``, its ``state`` mode, docs/attach.md).

RUN_B_REFED is run B's loop again, its recorder loaded with run A's state after step k before step k + 1
(``python -m harness state-for``, the recorder's ``load_state``; its meta.json says so: ``capture.refed``). At step
k + 1 both stacks then started from the same bits (and run A's lr), so a tensor that differs between A and the re-fed
run was made by step k + 1 itself, and one that differs between A and B but not once re-fed was carried in with the
state. Before step k + 1 the re-fed run must be run B bit for bit (the same loop), and at a step whose inputs A and
B already shared it must give B's plain step (the re-feed's own check, as ``train_refeed.reproduces``): otherwise its
attribution is no evidence, and the comparison is an ERROR or says "unfaithful".
"""

from __future__ import annotations

from pathlib import Path

from harness.case.ops import carried_quantities
from harness.compare import captured_runs
from harness.compare.captured_runs import CapturedRun, RunError
from harness.compare.tensors import EQUAL
from harness.compare.train_steps import compare_steps, quantity_of
from harness.run.steps import CAPTURE


def attribute(a: CapturedRun, b: CapturedRun, plain: list, folder: Path) -> dict:
    """The re-fed run in `folder` against run A, step k + 1's differences of `plain` (A against B) each made or
    carried in: {"status", "reason", "run", "step", "steps": [{"step", "counts", "made", "attribution"}]} (the
    built-in re-feed's entry, ``train_refeed.attribute``'s form)."""
    refed = captured_runs.read(folder)
    captured_runs.check(refed)
    said = (refed.meta.get(CAPTURE) or {}).get("refed") if isinstance(refed.meta.get(CAPTURE), dict) else None
    if not said:
        raise RunError(f"--refed {folder}: {folder / 'meta.json'} has no {CAPTURE}.refed entry: its recorder loaded "
                       "no state (load_state, or the Trainer callback's state_from)")
    if Path(said["from"]).resolve() != a.folder.resolve():
        raise RunError(f"--refed {folder}: re-fed from {said['from']} ({CAPTURE}.refed.from), not run A "
                       f"({a.folder.resolve()})")
    k = int(said["step"])
    step = k + 1
    case, _ = captured_runs.comparison_case(b, refed, steps=step)
    own_rows, _ = compare_steps(case, [b.side("a"), refed.side("b")])  # run B against its re-fed self
    _same_loop(b, own_rows, k, folder)
    case, _ = captured_runs.comparison_case(a, refed, steps=step)
    refed_rows, _ = compare_steps(case, [a.side("a"), refed.side("b")])
    made = {row.name for row in refed_rows if row.name.startswith(f"step{step}.") and row.status != EQUAL}
    entry = {"step": step, "counts": {}, "made": {}}
    for row in plain:
        if not row.name.startswith(f"step{step}."):
            continue
        quantity = quantity_of(row.name)
        how = _how(quantity, row.status != EQUAL, row.name in made, step)
        entry["counts"].setdefault(quantity, {})
        entry["counts"][quantity][how] = entry["counts"][quantity].get(how, 0) + 1
        if how.startswith("made"):
            entry["made"].setdefault(quantity, []).append(row.name)
    entry["made"] = {q: names[:10] for q, names in entry["made"].items()}
    entry["attribution"] = {q: ", ".join(f"{n} {how}" for how, n in sorted(counts.items()))
                            for q, counts in entry["counts"].items() if set(counts) != {"equal"}}
    unfaithful = _reproduces(a, own_rows, plain, k)
    return {"status": "unfaithful" if unfaithful else "ok", "reason": unfaithful, "run": str(folder), "step": step,
            "steps": [entry]}


def line(refed: dict) -> str:
    """The verdict's sentence on the re-fed step."""
    entry = refed["steps"][0]
    said = "; ".join(f"{q}: {how}" for q, how in entry["attribution"].items()) or "nothing differs"
    faith = f" (re-feed not faithful: {refed['reason']}: its attribution is not evidence)" if refed["reason"] else ""
    return f"; re-fed at step {entry['step']} from run A's state after step {entry['step'] - 1}: {said}{faith}"


def _how(quantity: str, differs: bool, differs_refed: bool, step: int) -> str:
    if not differs:
        return "equal"
    if quantity == "lr":  # the re-fed step took run A's lr
        return "made by the schedule"
    return f"made by step {step}" if differs_refed else "carried in"


def _same_loop(b: CapturedRun, own_rows: list, k: int, folder: Path) -> None:
    """Steps 1 to k of the re-fed run are run B's, bit for bit: it is B's loop, re-fed only at step k + 1."""
    differing = [row.name for row in own_rows if not row.name.startswith(f"step{k + 1}.") and row.status != EQUAL]
    if differing:
        raise RunError(f"--refed {folder}: before the re-fed step {k + 1} it departs from run B ({b.folder}) at "
                       f"{differing[0]} ({len(differing)} tensors): not run B's loop, or a loop that does not repeat "
                       "its own bits")


def _reproduces(a: CapturedRun, own_rows: list, plain: list, k: int) -> str:
    """Where A and B handed step k + 1 the same state and lr, the re-fed step must be B's plain step bit for bit;
    the reason it is not ("" where it is, or where the check does not apply)."""
    handed = {*carried_quantities(a.train.record), "expert_bias"}
    inputs = [row for row in plain if (row.name.startswith(f"step{k}.") and quantity_of(row.name) in handed)
              or row.name == f"step{k + 1}.lr"]
    if any(row.status != EQUAL for row in inputs):
        return ""
    differing = [row.name for row in own_rows if row.name.startswith(f"step{k + 1}.") and row.status != EQUAL]
    if not differing:
        return ""
    return (f"step {k + 1} started from the state run B had anyway, yet {len(differing)} tensors differ from run "
            f"B's, first {differing[0]}")
