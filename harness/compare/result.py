"""One result model for a run, the verdict rules, and exit codes; every renderer reads only this."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.compare.tensors import DIFF, EQUAL, TensorComparison
from harness.run import shards
from harness.run.orchestrate import SideResult

REPORT_SCHEMA = 1
BITWISE_PASS, DIFF_VERDICT, UNSUPPORTED, ERROR = "BITWISE_PASS", "DIFF", "UNSUPPORTED", "ERROR"
WITHIN_TOLERANCE, NONDETERMINISTIC = "WITHIN_TOLERANCE", "NONDETERMINISTIC"
EXIT_CODES = {BITWISE_PASS: 0, WITHIN_TOLERANCE: 0, DIFF_VERDICT: 1, ERROR: 2, UNSUPPORTED: 3, NONDETERMINISTIC: 4}
ORACLE_LABEL = "oracle"  # the extra side of --oracle; never decides the verdict, only measures distances


@dataclass
class CaseResult:
    run_id: str
    case_name: str
    device: str
    case: dict = field(default_factory=dict)
    checkpoint: dict = field(default_factory=dict)
    sides: list[SideResult] = field(default_factory=list)
    tensors: list[TensorComparison] = field(default_factory=list)
    verdict: str = ERROR
    message: str = ""
    expectation: dict = field(default_factory=dict)
    comparison: dict = field(default_factory=dict)  # --versus: one runner against itself (harness.levels)
    versus_oracle: dict = field(default_factory=dict)  # harness.versus_oracle
    repeats: dict = field(default_factory=dict)  # harness.compare.determinism, with --repeat N > 1
    tolerance: dict = field(default_factory=dict)  # harness.compare.tolerance.judge, when the case states a policy
    harness: dict = field(default_factory=dict)
    first_divergence: str | None = None  # first differing output in the op's topological order
    refeed: dict = field(default_factory=dict)  # per-op re-run from side a's tensors (compare --refeed)
    model: dict = field(default_factory=dict)  # model cases: harness.compare.model_outputs.summarise (+ "semantic")
    train: dict = field(default_factory=dict)  # training cases: harness.compare.train_steps.compare_steps' summary
    started_at: str = ""
    finished_at: str = ""
    interrupted: int | None = None  # the signal that stopped the run (its exit code is 128 + it)

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 128 + self.interrupted
        if self.verdict == ERROR:
            return EXIT_CODES[ERROR]
        if not self.expectation:  # nothing was expected (e.g. a diff of two dumps): the verdict decides
            return EXIT_CODES[self.verdict]
        if self.expectation.get("met"):
            return 0
        return EXIT_CODES[self.verdict] or 1  # an unmet expectation never exits 0

    def to_dict(self) -> dict:
        return {
            "schema": REPORT_SCHEMA, "run_id": self.run_id, "case_name": self.case_name, "device": self.device,
            "verdict": self.verdict, "exit_code": self.exit_code, "message": self.message,
            "expectation": self.expectation, "comparison": self.comparison, "case": self.case,
            "checkpoint": self.checkpoint,
            "sides": [s.to_dict() for s in self.sides], "tensors": [t.to_dict() for t in self.tensors],
            "versus_oracle": self.versus_oracle, "repeats": self.repeats, "tolerance": self.tolerance,
            "harness": self.harness, "started_at": self.started_at, "finished_at": self.finished_at,
            "first_divergence": self.first_divergence, "refeed": self.refeed, "interrupted": self.interrupted,
            "model": self.model, "train": self.train,
        }


def decide(sides: list[SideResult], tensors: list[TensorComparison], unstable: list[str] = (),
           tolerance: dict | None = None) -> tuple[str, str]:
    """The run's verdict and a one-line reason.

    `unstable` names the sides that disagreed with themselves across --repeat runs: then no cross-framework
    verdict is given, since equal or different bits could be luck. `tolerance` is the case policy's judgement.
    """
    for side in sides:  # the oracle only measures: its failure is reported in its own section, never here
        if side.status == "error" and side.label != ORACLE_LABEL:
            return ERROR, f"runner {side.label} ({side.runner}) failed: {side.reason}"
    differing = [t.name for t in tensors if t.status == DIFF]
    if unstable:
        first_runs = f"{len(differing)} tensors differ" if differing else "bitwise equal"
        return NONDETERMINISTIC, (f"{', '.join(unstable)} gave different bits on different runs; the first runs "
                                  f"were {first_runs}, which is no verdict while a side disagrees with itself")
    unsupported = [s for s in sides if s.status == "unsupported" and s.label != ORACLE_LABEL]
    if unsupported:
        return UNSUPPORTED, "; ".join(dict.fromkeys(f"{s.runner}: {s.reason}" for s in unsupported))
    broken = [t for t in tensors if t.status not in (EQUAL, DIFF)]
    if broken:
        return ERROR, "; ".join(f"{t.name}: {t.status} ({t.note})" for t in broken)
    departures = rank_departures(sides)
    if differing and tolerance and tolerance["within"] and not departures:
        return WITHIN_TOLERANCE, (f"{len(differing)} of {len(tensors)} tensors differ ({_names(differing)}), "
                                  "all within the case's tolerance")
    if differing or departures:
        beyond = [f"{t['name']}: {'; '.join(t['problems'])}" for t in (tolerance or {}).get("tensors", [])
                  if t["problems"]]
        across = (f"{len(differing)} of {len(tensors)} tensors differ: {_names(differing)}"
                  + (f"; beyond the case's tolerance: {' | '.join(beyond)}" if beyond else "")) if differing else ""
        return DIFF_VERDICT, "; ".join(filter(None, [*departures, across]))
    return BITWISE_PASS, f"all {len(tensors)} tensors bitwise equal"


def rank_departures(sides: list[SideResult]) -> list[str]:
    """One line per framework side whose ranks ended with other state than its rank 0 (a training run's step state,
    harness.run.steps.ranks_agree; an op's replicated outputs, harness.run.shards): rank, step and tensors named."""
    lines = []
    for side in sides:
        if side.label == ORACLE_LABEL:
            continue
        where = f"side {side.label} ({side.runner})"
        agree = side.meta.get("ranks_agree", {})
        for rank, first in agree.get("departures", {}).items():
            lines.append(f"{where}: rank {rank} departs from rank 0 at step {first['step']} in "
                         f"{_count(first['tensors'], 'state tensor')} (first: {first['first']})")
        for rank, names in shards.departures(side.meta.get("gather", {})).items():
            lines.append(f"{where}: rank {rank} departs from rank 0 in {_count(len(names), 'replicated tensor')} "
                         f"(first: {names[0]})")
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _names(names: list[str], shown: int = 12) -> str:
    """The first names in topological order, then how many more: a model's 800 tensors stay one readable line (the
    report's tables list them all)."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def first_divergence(tensors: list[TensorComparison]) -> str | None:
    """Outputs are listed in topological order (ops.py), so the first one not equal is where bits first part."""
    return next((t.name for t in tensors if t.status != EQUAL), None)
