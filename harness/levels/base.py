"""What a level is: the one interface the pipeline (``harness.pipeline``) drives, declared once.

A level says which runs a case starts (its two sides, their truth), how their outputs are compared, what a re-feed
does, and what it judges on top of the bits (a float64 case's semantic check). The pipeline looks the case's level
up (``harness.levels.level_of``) and never asks which one it is; a new level (inference, say) is one module
implementing this plus its cases.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.case.checkpoints import Checkpoint
from harness.case.registry import Case, CaseError
from harness.compare.result import CaseResult
from harness.run.orchestrate import SideResult, SideSpec

# what --versus can set on side b; each level names those it takes
AXES = ("tp", "impl", "dp", "ep", "batch", "pad", "cache", "environment")


@dataclass(frozen=True)
class Versus:
    """One runner against itself, side a at the case's `axis` and side b at `b` (``--versus tp=2``)."""

    axis: str
    b: int | str
    runner: str | None = None  # the runner on both sides (default: the case's first)

    def __post_init__(self):
        if self.axis not in AXES:
            raise ValueError(f"Versus.axis must be one of {', '.join(AXES)} (got {self.axis!r})")


@dataclass
class Run:
    """One comparison as the pipeline hands it to its level: the case as it runs, its inputs, the pair's specs and,
    once they ran, their results."""

    case: Case
    checkpoint: Checkpoint
    device: str
    run_dir: Path
    pythons: dict[str, str]
    timeout: float
    versus: Versus | None = None
    keep_tensors: bool = True  # False: a re-fed run's tensor files go once compared (CompareOptions.keep_tensors)
    pair: list[SideSpec] = field(default_factory=list)
    framework: list[SideResult] = field(default_factory=list)  # sides a and b, once run
    truth: SideResult | None = None
    refed: dict | None = None  # a training re-feed's comparisons, for the float64 check of every step
    follower: Any = None  # a training case's steps judged as they are written (harness.compare.train_follow)


class Level:
    """The default of every extension point; a level overrides what it does differently."""

    name = ""
    versus_axes: tuple[str, ...] = ()  # the axes --versus takes at this level
    truth_runner = "oracle"  # what its truth side runs (the nightly asks it which runners a night needs)

    def prepare(self, case: Case, dp: int | None, ep: int | None, steps_kept: str | None) -> Case:
        """The case with the options only this level takes; the default refuses them."""
        given = [name for name, value in (("--dp", dp), ("--ep", ep), ("--steps-kept", steps_kept)) if value]
        if given:
            raise CaseError(f"{case.source}: case {case.name!r}: {' and '.join(given)} "
                            f"{'is' if len(given) == 1 else 'are'} for training cases ({self.name}-level case, op "
                            f"{case.op!r})")
        return case

    def ranks(self, case: Case) -> int:
        """The processes one side of the case as written runs on, and the GPUs it needs."""
        return case.tp

    def check(self, case: Case, repeat: int, refeed: bool, versus: Versus | None) -> None:
        """Refuse a combination of options the level cannot run, before anything starts."""

    def versus(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        """(the case both sides run, the report's `comparison`): one runner against itself along `versus.axis`."""
        if versus.axis not in self.versus_axes:
            takes = f"take --versus {', '.join(self.versus_axes)}" if self.versus_axes else "take no --versus"
            raise CaseError(f"{case.source}: case {case.name!r}: --versus {versus.axis}: {self.name}-level cases "
                            f"{takes}")
        raise NotImplementedError

    def sides(self, run: Run) -> list[SideSpec]:
        raise NotImplementedError

    def truth(self, run: Run) -> SideSpec | None:
        """The truth side, or None when the case has none."""
        return None

    def follows(self, case: Case, device: str, keep_tensors: bool, versus: Versus | None) -> bool:
        """Whether ``follow`` judges the case's outputs as they are written (the disk it needs then is less)."""
        return False

    def follow(self, run: Run, truth: SideSpec | None, refeed: bool) -> None:
        """Start judging the sides' outputs as they are written, before they run (``run.follower``); the default
        judges them after."""

    def compare(self, run: Run, result: CaseResult) -> None:
        """Both sides ran: fill result.tensors (in the order the first divergence reads) and the level's summary."""
        raise NotImplementedError

    def versus_truth(self, run: Run, result: CaseResult) -> None:
        """Each side's distance from the truth (also when a side failed: the truth section says so)."""

    def refeed(self, run: Run, result: CaseResult, asked: bool) -> None:
        """Re-run side b from side a's tensors when asked (or when the level's judgement needs it)."""

    def judge(self, run: Run, result: CaseResult) -> None:
        """After the verdict: what the level decides on top of the bits (a float64 case's semantic check)."""

    def unexpected(self, run: Run, result: CaseResult) -> list[str]:
        """What the level found that no expectation may pass (a side far from the truth): each one an unmet
        expectation's problem."""
        return []

    def notes(self, run: Run, result: CaseResult) -> list[str]:
        """What the reader must know beyond the verdict (appended to its message)."""
        return []


def same_runner(case: Case, versus: Versus, runners: tuple[str, ...]) -> Case:
    """The case with `versus.runner` (default its first) on both sides, no planted flip (both sides are one stack)."""
    runner = versus.runner or case.runners[0]
    if runner not in runners:
        raise CaseError(f"{case.source}: case {case.name!r}: --runner must be one of {', '.join(runners)} "
                        f"(got {runner!r})")
    return replace(case, runners=(runner, runner), perturb=None)
