"""``--repeat N``: does each runner give the same bits every time it runs?

A cross-framework "bitwise equal" (or "differs") is only evidence when each side is stable: a side
that changes its own bits between runs (atomics, split-K heuristics, thread scheduling) makes any
single comparison luck. Every repeat runs on the same checkpoint file and is compared tensor by tensor with
that side's first run, with the same statistics as the cross-framework comparison. Repeats run in the side's
worker (harness.run.workers), and one more in a fresh process, so state that differs between processes (a
per-process seed, an allocator, a thread pool) shows too; each entry says where it ran.
"""

from __future__ import annotations

from harness.case.checkpoints import load_tensors
from harness.case.registry import Case
from harness.compare.result import ORACLE_LABEL
from harness.compare.tensors import DIFF, compare_tensor
from harness.run.orchestrate import SideResult, SideSpec


def repeat_sides(first_round: list[SideResult], sides: list[SideSpec], run: int) -> list[SideSpec]:
    """Run number `run` of every side whose first run succeeded; none after a crash (the verdict is ERROR)."""
    if any(s.status == "error" and s.label != ORACLE_LABEL for s in first_round):
        return []
    succeeded = {s.label for s in first_round if s.status == "ok"}
    return [side._replace(label=f"{side.label}.{run}", folder=f"{side.label}.{run}-{side.folder.split('-', 1)[1]}")
            for side in sides if side.label in succeeded]


def self_consistency(case: Case, sides: list[SideResult], runs: int) -> dict:
    """For each side with repeats: each later run against the first, per tensor."""
    if runs < 2:
        return {}
    by_label = {s.label: s for s in sides}
    report = {"runs": runs, "sides": {}}
    for side in sides:
        base, _, run = side.label.partition(".")
        if not run or by_label.get(base) is None:
            continue
        first = by_label[base]
        entry = report["sides"].setdefault(base, {"runner": first.runner, "consistent": True, "repeats": [],
                                                  "first_process": process_of(first)})
        repeat = {"label": side.label, "run": int(run), "status": side.status, "process": process_of(side),
                  "differing": [], "tensors": []}
        if side.status == "ok" and first.status == "ok":
            reference, again = load_tensors(first.outputs), load_tensors(side.outputs)
            comparisons = [compare_tensor(spec.name, again.get(spec.name), reference.get(spec.name))
                           for spec in case.output_specs()]
            repeat["tensors"] = [c.to_dict() for c in comparisons]
            repeat["differing"] = [c.name for c in comparisons if c.status == DIFF]
            entry["consistent"] = entry["consistent"] and not repeat["differing"]
        entry["repeats"].append(repeat)
    return report


def process_of(side: SideResult) -> str:
    """'shared worker 1234, cell 2' or 'fresh process': where a run ran (harness.run.workers)."""
    process = side.meta.get("process", {})
    if process.get("mode") == "shared worker":
        return f"shared worker {process.get('pid')}, cell {process.get('cell')}"
    return process.get("mode", "fresh process")


def unstable(report: dict) -> list[str]:
    """'a (megatron)' for each side that disagreed with itself."""
    return [f"{label} ({entry['runner']})" for label, entry in report.get("sides", {}).items()
            if not entry["consistent"]]
