"""Re-feed in time (``compare CASE --refeed`` on a training case, docs/training.md): two more runs of side b's stack,
each step starting from side a's state, so every difference at step k is attributed to something step k did or to
what it was handed.

- ``state``: before each step k > 1 side b loads side a's state after step k - 1 (parameters, masters, the
  optimizer's state, routing biases) and, at every step, side a's lr; its step counts are its own (it made the same
  number of steps). A quantity that differs here was made by step k itself (its forward/backward, norm, clip or
  update).
- ``update``: the same, and side a's accumulated gradients of step k in place of side b's, so side b's norm, clip and
  optimizer run on side a's inputs alone: what differs here is made by those formulas, not by the gradients.

Attribution per step and quantity (``attribute``), counting tensors:
- lr: both re-fed runs take side a's lr, so a plain difference is made by the schedule;
- loss, gradients: made by the step's forward/backward where they differ when re-fed, else carried in;
- norm, clip, the optimizer's state (its record's: harness.optimizers), masters, parameters: made by the
  optimizer (its norm, clip and update together) where they differ on side a's gradients too, else made by the step's
  gradients where they differ re-fed, else carried in (with clip_grad = 0 the update's formula stands alone: the knob
  that separates it from the norm's);
- routing bias: made by the step (Megatron's update of it) where it differs re-fed, else carried in.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from harness import resources
from harness.case.ops import carried_quantities
from harness.case.registry import Case, CaseError
from harness.compare.tensors import EQUAL
from harness.compare.train_steps import compare_step, compare_steps, quantity_of
from harness.run import orchestrate, steps
from harness.run.follow import POLL_SECONDS
from harness.run.orchestrate import SideResult, SideSpec
from harness.run.steps import PACE, give_back, step_file

MODES = ("state", "update")
GRADIENT_MADE = ("loss", "grad")
# the schedule's, the forward/backward's, and Megatron's routing-bias update: none is the optimizer step's
NOT_UPDATE_MADE = ("lr", *GRADIENT_MADE, "expert_bias")


def update_made(quantity: str) -> bool:
    """Whether the optimizer step makes `quantity`: the norm, the clip factor, the optimizer's state, the masters and
    the parameters, whichever optimizer (every quantity of the step but the lr, the loss, the gradients and the
    routing bias)."""
    return quantity not in NOT_UPDATE_MADE


def run(case: Case, checkpoint, pair: list[SideSpec], sides: list[SideResult], plain: list, device: str,
        run_dir: Path, pythons: dict, timeout: float, keep: bool = True) -> tuple[dict, dict[str, list] | None]:
    """Side b re-fed from side a, in both modes, after the pair: (per step and quantity what made each difference,
    with the re-feed's own check; each mode's comparisons with side a, None when a re-fed run failed). `keep` False:
    a re-fed run that ran and was compared gives its tensor files back before the next one runs (a night's peak:
    every read of them is done, its comparisons are in memory); a run that failed keeps them. A night's case on a CPU
    runs them beside the pair instead (``Beside``)."""
    if not every_step_kept(case):
        raise CaseError(f"case {case.name!r}: --refeed needs every step's tensors of side a (train.steps_kept = "
                        f"\"all\"; got {list(case.train.steps_kept)})")
    results, compared, faithful = {}, {}, {}
    for mode, spec in refed_specs(pair, sides[0].folder, paced=False).items():
        result = results[mode] = orchestrate.run_sides(case, [spec], device, run_dir, pythons, timeout)[0]
        if result.status != "ok":
            break
        compared[mode], _ = compare_steps(case, [sides[0], result])
        faithful[mode] = reproduces(case, plain, sides[1], result, mode)
        if not keep:
            _drop_tensors(Path(result.folder), Path(run_dir))
    return outcome(plain, results, compared, faithful)


def every_step_kept(case: Case) -> bool:
    """Whether side a keeps every step's tensors, which the re-fed runs load."""
    return case.train.steps_kept == tuple(range(1, case.train.steps + 1))


def refed_specs(pair: list[SideSpec], side_a: Path, paced: bool) -> dict[str, SideSpec]:
    """Each mode's re-fed run of side b's stack, reading side a's steps in `side_a`; `paced`: followed as it writes."""
    spec_b, specs = pair[1], {}
    for mode in MODES:
        config = {**(spec_b.config or {}), "train_refeed": {"mode": mode, "from": str(side_a.resolve())},
                  **({PACE: True} if paced else {})}
        specs[mode] = spec_b._replace(label=f"b.refeed-{mode}", folder=f"b-{spec_b.runner}-refeed-{mode}",
                                      config=config)
    return specs


def outcome(plain: list, results: dict[str, SideResult], compared: dict, faithful: dict) -> tuple[dict, dict | None]:
    """The re-feed's record from each mode's run, in ``MODES`` order: the first that failed ends it, as when the
    modes run one after the other."""
    runs = {}
    for mode in MODES:
        result = results[mode]
        runs[mode] = result.to_dict()
        if result.status != "ok":
            return {"status": result.status, "reason": f"re-fed side b ({mode}): {result.reason}", "runs": runs}, None
    unfaithful = [f"{mode} at step {miss['step']} ({miss['count']} tensors, first {miss['tensors'][0]})"
                  for mode, check in faithful.items() for miss in check["not_reproduced"]]
    return {"status": "unfaithful" if unfaithful else "ok",
            "reason": f"a re-fed step that starts from side b's own state does not give side b's plain bits: "
                      f"{'; '.join(unfaithful)}" if unfaithful else "",
            "runs": runs, "faithful": faithful,
            "steps": attribute(plain, compared["state"], compared["update"])}, compared


def _drop_tensors(folder: Path, run_dir: Path) -> None:
    """The tensor files of one re-fed run's folder (its meta, logs and request stay); never outside the run's."""
    if not folder.resolve().is_relative_to(run_dir.resolve()):
        raise CaseError(f"re-fed run folder {folder} is not inside the run's folder {run_dir}: nothing deleted")
    with resources.boundary("re-fed run folder", folder):
        for file in folder.rglob("*.safetensors"):
            file.unlink()


def reproduces(case: Case, plain: list, side_b: SideResult, refed: SideResult, mode: str) -> dict:
    """The re-feed's own check: at a step whose inputs side a and side b shared in the plain run (the state after the
    step before, the lr, and for ``update`` the step's gradients, all bitwise equal), loading side a's state changed
    nothing, so the re-fed step must give side b's plain step bit for bit. {"checked": steps, "not_reproduced":
    [{"step", "count", "tensors"}]}."""
    checked = checked_steps(case, plain, mode)
    missed = [miss for step in checked if (miss := not_reproduced(case, step, side_b, refed))]
    return {"checked": checked, "not_reproduced": missed}


def checked_steps(case: Case, plain: list, mode: str) -> list[int]:
    """The steps ``reproduces`` checks in `mode`: those whose inputs the plain run's sides shared (a step's answer
    reads the plain comparisons of that step and the one before only)."""
    differs = {c.name for c in plain if c.status != EQUAL}
    by_step: dict[int, set[str]] = {}
    for name in differs:
        by_step.setdefault(int(name.split(".")[0].removeprefix("step")), set()).add(quantity_of(name))
    flip = case.train.flip
    planted = flip.after_step + 1 if flip and flip.side == "b" else None  # side b's state held a bit its step file
    # does not show, which the re-fed run's load overwrote
    handed = {*carried_quantities(case.train.record), "expert_bias"}  # what a step hands to the next one
    checked = []
    for step in range(1, case.train.steps + 1):
        before = by_step.get(step - 1, set()) & handed if step > 1 else set()
        now = by_step.get(step, set()) & ({"lr", "grad"} if mode == "update" else {"lr"})
        if not (before or now or step == planted):
            checked.append(step)
    return checked


def not_reproduced(case: Case, step: int, side_b: SideResult, refed: SideResult) -> dict | None:
    """Where the re-fed run's step `step` is not side b's plain step: {"step", "count", "tensors"}, or None."""
    differing = [row.name for row in compare_step(case, step, [side_b, refed]) if row.status != EQUAL]
    return {"step": step, "count": len(differing), "tensors": differing[:10]} if differing else None


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
    if update_made(quantity):
        if update:
            return "made by the optimizer on side a's gradients"
        return "made by the step's gradients" if state else "carried in"
    return "made by the step" if state else "carried in"


class RefeedJudge:
    """One re-fed run's step k against side a's (and side b's where the re-feed's check reads it), then given back.
    `plain`: the pair's comparisons, of step k at least (a step's check reads that step's and the one before)."""

    def __init__(self, case: Case, side_a: SideResult, side_b: SideResult, refed: SideResult, mode: str,
                 plain: list):
        self.case, self.side_a, self.side_b, self.refed = case, side_a, side_b, refed
        self.mode, self.plain = mode, plain
        self.rows, self.checked, self.missed, self.judged = [], [], [], 0

    def step(self, step: int) -> None:
        self.rows += compare_step(self.case, step, [self.side_a, self.refed])
        if step in checked_steps(self.case, self.plain, self.mode):
            self.checked.append(step)
            if miss := not_reproduced(self.case, step, self.side_b, self.refed):
                self.missed.append(miss)
        give_back(step_file(self.refed.folder, step))
        self.judged = step


class Beside:
    """The two re-fed runs of a night's case on a CPU, started with the pair and judged as they write (issue 47: run
    after the pair, they read every step of side a, which stayed whole until they ended). Once the pair's step is
    judged (side b's given back unless the re-feed's check reads it), side a's step is handed to the state run
    (``steps.handed_marker``), whose step is judged and given back, then to the update run, as when they ran one
    after the other; side a's step goes once both have read it (``steps.fed_marker``: their next step's state). So
    side a holds the step they read besides the first divergence, and one re-fed step is whole at a time."""

    def __init__(self, case: Case, pair: list[SideSpec], sides: list[SideResult], device: str, run_dir: Path,
                 pythons: dict, timeout: float, plain: list):
        self.case, self.side_a, self.run_dir = case, sides[0], Path(run_dir)
        specs = refed_specs(pair, sides[0].folder, paced=True)
        self.judges = {mode: RefeedJudge(case, sides[0], sides[1],
                                         SideResult(spec.label, spec.runner, "ok", self.run_dir / spec.folder, ""),
                                         mode, plain) for mode, spec in specs.items()}
        self.ended: set[str] = set()  # the modes whose run ended before a step: followed no more
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refeed-beside")
        self.runs = thread.submit(contextvars.copy_context().run, orchestrate.run_sides, case, list(specs.values()),
                                  device, run_dir, pythons, timeout)
        thread.shutdown(wait=False)  # the thread ends with its one task

    def reads(self, step: int) -> bool:
        """Whether a re-fed run still followed will read side b's step `step` (the re-feed's check)."""
        return any(mode not in self.ended and step in checked_steps(self.case, judge.plain, mode)
                   for mode, judge in self.judges.items())

    def step(self, step: int) -> None:
        """The re-fed runs' step `step`, once the pair's is judged; returns once they have read all they take of
        side a's step (at the last step: once it is judged)."""
        for mode, judge in self.judges.items():  # one at a time: one re-fed step written at once
            if step > 1:
                steps.mark(judge.refed.folder, steps.consumed_marker(judge.refed.folder, step - 1).name)
            steps.mark(self.side_a.folder, steps.handed_marker(self.side_a.folder, step, mode).name)
            if self._landed(mode, steps.step_file(judge.refed.folder, step)):
                judge.step(step)
        if step < self.case.train.steps:
            for mode in MODES:
                self._landed(mode, steps.fed_marker(self.side_a.folder, step, mode))

    def _landed(self, mode: str, path: Path) -> bool:
        """Wait until `path` is there, or the mode's run ended without it (then it is followed no more)."""
        ended = self.judges[mode].refed.folder / steps.STEPS_DIR / steps.ENDED
        while mode not in self.ended:
            over = ended.exists() or self.runs.done()  # first: then what it wrote is all there is
            if path.exists():
                return True
            if over:
                self.ended.add(mode)
            else:
                time.sleep(POLL_SECONDS)
        return False

    def release(self) -> None:
        """Nothing more is handed over or judged: the re-fed runs write on and end (side a's folder too: it may
        have ended)."""
        for folder in (self.side_a.folder, *(judge.refed.folder for judge in self.judges.values())):
            if folder.exists() and not (folder / steps.STEPS_DIR / steps.RELEASED).exists():  # started
                steps.mark(folder, steps.RELEASED)

    def join(self) -> None:
        wait([self.runs])

    def results(self, plain: list) -> tuple[dict, dict | None]:
        """Once the pair is compared: the re-feed's record, as ``run`` gives it (the runs joined; a night's: the tensor
        files of each run compared go)."""
        results = dict(zip(MODES, self.runs.result(), strict=True))
        compared, faithful = {}, {}
        for mode, judge in self.judges.items():
            if results[mode].status != "ok":
                break
            if judge.judged != self.case.train.steps:
                raise RuntimeError(f"following the re-fed run ({mode}) judged {judge.judged} of "
                                   f"{self.case.train.steps} steps, though it ended ok: nothing compares the steps "
                                   "given back")
            compared[mode] = judge.rows
            faithful[mode] = {"checked": judge.checked, "not_reproduced": judge.missed}
            _drop_tensors(Path(results[mode].folder), self.run_dir)
        return outcome(plain, results, compared, faithful)
