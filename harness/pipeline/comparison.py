"""One comparison, start to finish: case -> checkpoint -> runners -> comparator -> report, at any level.

The case's level (``harness.levels``) says which sides run, what their truth is, how their outputs are compared and
judged; this module never asks which level it is. Whatever goes wrong (a bad case file, a corrupted checkpoint, a
crashing or hanging runner), the run ends with a report in its own new folder and an ERROR verdict that says why.
"""

from __future__ import annotations

import contextvars
import math
import platform
import sys
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from harness import __version__
from harness.case import checkpoints
from harness.case.registry import CASES_DIR, Case, CaseError, Registry
from harness.compare import determinism, tolerance
from harness.compare.expectation import check_expectation
from harness.compare.result import ORACLE_LABEL, CaseResult, decide, first_divergence, rank_departures
from harness.levels import Run, Versus, level_of
from harness.pipeline import disk_budget, failsafe
from harness.pipeline.run_folder import REPORTS_DIR, new_run_dir, now
from harness.report import case_report as report
from harness.run import orchestrate, workers
from harness.run.protocol import host_provenance


@dataclass(frozen=True)
class CompareOptions:
    """Everything a comparison can be asked to do beyond the case itself; commands build one and `replace` fields.

    `runners`: another pair than the case's (``--runners A,B``); `tp`: another TP size; `versus`: one runner against
    itself, side a as the case says and side b at another tensor-parallel size, Paddle implementation level, or number
    of data- or expert-parallel ranks (``--versus tp=2``; each level names the axes it takes); `oracle`: also run the
    truth and measure each side's distance from it; `repeat`: run each side that many times and check it agrees
    with itself; `config_overrides`: knobs set over the case's (the gate matrix); `refeed_ops`: re-run side b from
    side a's tensors (each op of a block, each module of a model, each training step); `pythons`: an interpreter per
    runner (``--python RUNNER=PATH``); `fresh_process`: every side in a process of its own, never in a worker
    (``harness.run.workers``); training cases: `dp` / `ep` data- and expert-parallel ranks over the case's train.dp /
    train.ep, `steps_kept` over its train.steps_kept (docs/training-ranks.md); `keep_tensors` False: the tensor files of
    a training case's re-fed runs go once they are compared (a night's: its peak, docs/nightly.md#disk).
    """

    device: str = "cpu"
    tokens: int | None = None
    runners: tuple[str, str] | None = None
    tp: int | None = None
    versus: Versus | None = None
    dp: int | None = None
    ep: int | None = None
    oracle: bool = True
    repeat: int = 1
    refeed_ops: bool = False
    fresh_process: bool = False
    config_overrides: Mapping[str, object] = field(default_factory=dict)
    weights_file: str | None = None
    steps_kept: str | None = None  # training cases: "all", "last" or "1,3,100" over the case's train.steps_kept
    keep_tensors: bool = True  # False (a night's): a re-fed training run's tensor files go once it is compared
    timeout: float = 1800.0
    pythons: Mapping[str, str] = field(default_factory=dict)
    cases_dir: Path = CASES_DIR
    checkpoints_dir: Path = checkpoints.CHECKPOINTS_DIR
    reports_dir: Path = REPORTS_DIR

    def __post_init__(self):
        """Refuse options that make no sense before anything starts (a library caller gets the CLI's checks)."""
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"CompareOptions.timeout must be a positive number of seconds (got {self.timeout!r})")
        if not (isinstance(self.repeat, int) and self.repeat >= 1):
            raise ValueError(f"CompareOptions.repeat must be an integer of at least 1 (got {self.repeat!r})")
        if self.versus is not None and not isinstance(self.versus, Versus):
            raise ValueError(f"CompareOptions.versus must be a Versus(axis, b) (got {self.versus!r})")


DEFAULT_OPTIONS = CompareOptions()
FRESH_PROCESS_HELP = ("start every runner afresh for each cell and repeat, instead of keeping one worker process per "
                      "runner across a sweep, nightly, gate matrix or --repeat")


def compare_case(name: str, options: CompareOptions = DEFAULT_OPTIONS) -> tuple[CaseResult, Path]:
    """Compare the case's two runners as `options` say; the result and the run's own new folder."""
    return finish_case(start_case(name, options))


@dataclass
class Started:
    """A comparison whose framework sides have run (the truth may still be running on a CPU): everything
    ``finish_case`` needs, or the error that stopped it."""

    result: CaseResult
    run_dir: Path
    options: CompareOptions
    clock: _Clock
    run: Run | None = None  # the case as it runs, its checkpoint and sides (harness.levels.Run)
    extras: Future | None = None  # the truth's round, run beside the pair
    first_round: int = 0  # result.sides[:first_round] are the pair's first runs; repeats follow
    runs: int = 1
    error: BaseException | None = None


def start_case(name: str, options: CompareOptions = DEFAULT_OPTIONS) -> Started:
    """The first half of a comparison: the case, its checkpoint, the framework sides (and their repeats). On a CPU the
    truth runs beside them and may still run when this returns, so a sweep starts its next cell while this cell's
    truth, comparisons and report are finished (``finish_case``). Never raises: an error is kept for ``finish_case``
    to record."""
    o = options
    pythons = dict(o.pythons)
    run_id, run_dir = new_run_dir(Path(o.reports_dir), name)
    result = CaseResult(run_id=run_id, case_name=name, device=o.device, started_at=now(),
                        harness={"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                                 "host": host_provenance(), "node": platform.node()})
    started = Started(result, run_dir, o, _Clock(result.harness.setdefault("seconds", {})))
    try:
        case = _load_case(name, o.cases_dir, o.tokens, o.device, o.runners)
        case = case.with_tp(o.tp) if o.tp is not None else case
        if o.config_overrides:
            case = replace(case, config={**case.config, **o.config_overrides})
        level = level_of(case)
        case = level.prepare(case, o.dp, o.ep, o.steps_kept)
        if o.versus is not None:
            case, result.comparison = level.versus(case, o.versus)
        result.case = describe_case(case)
        checkpoints.check_memory(case)  # first: a case that cannot fit in memory is refused for that
        result.harness["disk"] = disk_budget.check(case, Path(o.reports_dir), Path(o.checkpoints_dir), o.repeat,
                                                   o.oracle, o.refeed_ops,
                                                   level.follows(case, o.device, o.keep_tensors, o.versus))
        checkpoint = checkpoints.prepare(case, Path(o.checkpoints_dir), o.weights_file)
        started.clock.lap("checkpoint")
        result.checkpoint = {"folder": str(checkpoint.folder), "digest": checkpoint.manifest["digest"],
                             "generator_version": checkpoint.manifest["generator_version"],
                             "perturbed": checkpoint.manifest.get("perturbed")}
        level.check(case, o.repeat, o.refeed_ops, o.versus)
        run = started.run = Run(case, checkpoint, o.device, run_dir, pythons, o.timeout, o.versus,
                                keep_tensors=o.keep_tensors)
        pair = run.pair = level.sides(run)
        truth = level.truth(run) if o.oracle and case.truth and "oracle" not in case.runners else None
        with workers.fresh_processes(o.fresh_process):  # re-fed runs it starts beside the pair start as the pair
            level.follow(run, truth, o.refeed_ops)
        extra = [truth] if truth else []
        with workers.fresh_processes(o.fresh_process), workers.serving(run_dir / "workers") if o.repeat > 1 else \
                nullcontext(workers.active()) as pool:
            try:
                if extra and o.device == "cpu":  # beside the pair; on a GPU every side has the device alone, in turn
                    started.extras = _beside(orchestrate.run_sides, case, extra, o.device, run_dir, pythons,
                                             o.timeout)
                    extra = []
                result.sides = orchestrate.run_sides(case, pair + extra, o.device, run_dir, pythons, o.timeout)
                first_round, runs = list(result.sides), o.repeat + (1 if pool is not None and o.repeat > 1 else 0)
                started.first_round, started.runs = len(first_round), runs
                # repeats in the worker, then one more in a fresh process: process-level nondeterminism shows too
                for again_run in range(2, runs + 1):
                    again = determinism.repeat_sides(first_round, pair, again_run)
                    with workers.fresh_processes(again_run > o.repeat):
                        result.sides += orchestrate.run_sides(case, again, o.device, run_dir, pythons, o.timeout)
            finally:  # this run's own workers end with this block: the truth's round first, a signal's too
                if o.repeat > 1 and started.extras:
                    wait([started.extras])
        started.clock.lap("runners")
    except BaseException as error:  # every failure, the harness's own and a signal included: finish_case records it
        started.error = error
    return started


def finish_case(started: Started) -> tuple[CaseResult, Path]:
    """The second half: the truth's round joined, comparisons, verdict, expectation, report (see ``start_case``)."""
    result, run_dir, o, run = started.result, started.run_dir, started.options, started.run
    try:
        extras = started.extras.result() if started.extras else []
        started.clock.lap("oracle")
        if run is not None and run.follower is not None:  # the runs have ended: its last steps judged
            run.follower.finish(raise_error=started.error is None)
        if started.error is not None:
            raise started.error
        result.sides[started.first_round:started.first_round] = extras  # a, b, the truth, then repeats
        level = level_of(run.case)
        by_label = {side.label: side for side in result.sides}
        run.framework, run.truth = [by_label["a"], by_label["b"]], by_label.get(ORACLE_LABEL)
        if all(side.status == "ok" for side in run.framework):
            level.compare(run, result)
            result.first_divergence = first_divergence(result.tensors)
            with workers.fresh_processes(o.fresh_process):  # the re-fed runs start as the pair did
                level.refeed(run, result, o.refeed_ops)
        level.versus_truth(run, result)
        result.repeats = determinism.self_consistency(run.case, result.sides, started.runs)
        result.tolerance = tolerance.judge(run.case.tolerance, result.tensors)
        result.verdict, result.message = decide(result.sides, result.tensors, determinism.unstable(result.repeats),
                                                result.tolerance)
        result.message += "".join(f"; {note}" for note in level.notes(run, result))
        level.judge(run, result)
        if o.versus is None:  # the expectation is about the case's runners; a runner against itself: findings
            result.expectation = check_expectation(run.case.expect, result.verdict, result.tensors,
                                                   rank_departures(result.sides))
            found = level.unexpected(run, result)
            if found:
                result.expectation["problems"] += found
                result.expectation["met"] = False
        started.clock.lap("compare")
    except BaseException as error:  # every failure, the harness's own and a signal included: a verdict, a report
        failsafe.record(result, error)
    failsafe.finish(result, run_dir, report.write)
    return result, run_dir


def _beside(function, *args) -> Future:
    """`function(*args)` in a thread of its own, in this context (the worker pool, fresh-process setting)."""
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oracle-round")
    future = thread.submit(contextvars.copy_context().run, function, *args)
    thread.shutdown(wait=False)  # the thread ends with its one task
    return future


class _Clock:
    """Wall seconds of each phase of a run, into `seconds` (report.json's harness.seconds)."""

    def __init__(self, seconds: dict):
        self.seconds, self.last = seconds, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self.last, 3)
        self.last = now


def describe_case(case: Case) -> dict:
    described = asdict(case)
    described["source"] = str(case.source)
    return described


def _load_case(name: str, cases_dir: Path, tokens: int | None, device: str,
               runners: tuple[str, str] | None = None) -> Case:
    case = Registry.load(Path(cases_dir)).get(name)
    if tokens is not None:
        case = case.with_tokens(tokens)
    if runners is not None:
        case = case.with_runners(runners)
    if device not in case.devices:
        raise CaseError(f"{case.source}: case {name!r}: field 'devices': does not list {device!r} "
                        f"(got {list(case.devices)})")
    return case
