"""One comparison, start to finish: case -> checkpoint -> runners -> comparator -> report.

Whatever goes wrong (a bad case file, a corrupted checkpoint, a crashing or hanging runner), the run
ends with a report in its own new folder and an ERROR verdict that says why.
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
from harness.case.ops import KNOBS, MODEL_OPS, TRAIN_OPS
from harness.case.registry import CASES_DIR, RUNNERS, TP_SIZES, Case, CaseError, Registry
from harness.case.train import EXPERT_PARALLEL_RUNNERS, parse_steps_kept, with_ranks
from harness.commands import failsafe
from harness.commands.run_folder import REPORTS_DIR, new_run_dir, now
from harness.compare import determinism, model, model_refeed, refeed, tolerance, train, train_float64, train_refeed
from harness.compare.dumps import Dump, compare_dumps
from harness.compare.expectation import check_expectation
from harness.compare.result import ERROR, ORACLE_LABEL, CaseResult, decide, first_divergence, rank_departures
from harness.compare.versus_oracle import oracle_side, versus_oracle
from harness.report import case_report as report
from harness.run import orchestrate, workers
from harness.run.protocol import host_provenance


@dataclass(frozen=True)
class CompareOptions:
    """Everything a comparison can be asked to do beyond the case itself; commands build one and `replace` fields.

    `runners`: another pair than the case's (``--runners A,B``); `tp`: another TP size; `versus_tp`: one runner
    (`runner`, default the case's first) at the case's TP size (side a) against itself at `versus_tp` (side b),
    on the same checkpoint; `versus_impl`: the Paddle runner at the case's implementation level
    (``config.paddle_impl``, side a) against itself at another (side b), on the same checkpoint; `oracle`: also
    run the truth oracle and measure each side's distance from it (skipped when a side already is the oracle);
    `repeat`: run each side that many times and check it agrees with itself;
    `config_overrides`: knobs set over the case's (the gate matrix); `refeed_ops`: for multi-op blocks, re-run
    each op on side b from side a's tensors (model cases: each module, harness.compare.model_refeed);
    `pythons`: an interpreter per runner (``--python RUNNER=PATH``); `fresh_process`: every side in a process of
    its own, never in a worker (``harness.run.workers``); training cases: `dp` / `ep` data- and expert-parallel
    ranks over the case's train.dp / train.ep, and `versus_dp` / `versus_ep`: one runner at the case's (side a)
    against itself at another size (side b), on the same global batch (docs/training-ranks.md).
    """

    device: str = "cpu"
    tokens: int | None = None
    runners: tuple[str, str] | None = None
    tp: int | None = None
    versus_tp: int | None = None
    runner: str | None = None
    versus_impl: str | None = None
    dp: int | None = None
    ep: int | None = None
    versus_dp: int | None = None
    versus_ep: int | None = None
    oracle: bool = True
    repeat: int = 1
    refeed_ops: bool = False
    fresh_process: bool = False
    config_overrides: Mapping[str, object] = field(default_factory=dict)
    weights_file: str | None = None
    steps_kept: str | None = None  # training cases: "all", "last" or "1,3,100" over the case's train.steps_kept
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
        versus = [name for name in ("versus_tp", "versus_impl", "versus_dp", "versus_ep")
                  if getattr(self, name) is not None]
        if len(versus) > 1:
            raise ValueError(f"CompareOptions.{' and '.join(versus)} compare one thing at a time: give one of them")


DEFAULT_OPTIONS = CompareOptions()
FRESH_PROCESS_HELP = ("start every runner afresh for each cell and repeat, instead of keeping one worker process per "
                      "runner across a sweep, nightly, gate matrix or --repeat")


def compare_case(name: str, options: CompareOptions = DEFAULT_OPTIONS) -> tuple[CaseResult, Path]:
    """Compare the case's two runners as `options` say; the result and the run's own new folder."""
    return finish_case(start_case(name, options))


@dataclass
class Started:
    """A comparison whose framework sides have run (the truth oracle may still be running on a CPU): everything
    ``finish_case`` needs, or the error that stopped it."""

    result: CaseResult
    run_dir: Path
    options: CompareOptions
    clock: _Clock
    case: Case | None = None
    checkpoint: checkpoints.Checkpoint | None = None
    pair: list = field(default_factory=list)
    extras: Future | None = None  # the oracle's (or a model's float64 truth's) round, run beside the pair
    first_round: int = 0  # result.sides[:first_round] are the pair's first runs; repeats follow
    runs: int = 1
    versus: tuple = (None, None, None)  # (tps, impls, ranked): what a --versus-* run compares
    error: BaseException | None = None


def start_case(name: str, options: CompareOptions = DEFAULT_OPTIONS) -> Started:
    """The first half of a comparison: the case, its checkpoint, the framework sides (and their repeats). On a CPU the
    truth oracle runs beside them and may still run when this returns, so a sweep starts its next cell while this
    cell's oracle, comparisons and report are finished (``finish_case``). Never raises: an error is kept for
    ``finish_case`` to record."""
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
        if o.steps_kept is not None:
            case = _with_steps_kept(case, o.steps_kept)
        if o.dp is not None or o.ep is not None:
            case = _with_ranks(case, o.dp, o.ep)
        tps = impls = ranked = None
        if o.versus_tp is not None:
            case, tps = _versus_tp(case, o.versus_tp, o.runner or case.runners[0])
            result.comparison = {"kind": "tensor_parallel", "runner": case.runners[0], "tp_a": tps[0], "tp_b": tps[1]}
        if o.versus_impl is not None:
            case, impls = _versus_impl(case, o.versus_impl)
            result.comparison = {"kind": "paddle_impl", "runner": case.runners[0], "impl_a": impls[0],
                                 "impl_b": impls[1]}
        if o.versus_dp is not None or o.versus_ep is not None:
            kind = "dp" if o.versus_dp is not None else "ep"
            case, ranked = _versus_ranks(case, kind, o.versus_dp if kind == "dp" else o.versus_ep,
                                         o.runner or case.runners[0])
            result.comparison = {"kind": RANK_KINDS[kind], "runner": case.runners[0],
                                 **{f"{k}_{label}": sizes[k] for label, sizes in zip("ab", ranked, strict=True)
                                    for k in ("dp", "ep")}}
        started.case, started.versus = case, (tps, impls, ranked)
        result.case = describe_case(case)
        checkpoint = started.checkpoint = checkpoints.prepare(case, Path(o.checkpoints_dir), o.weights_file)
        started.clock.lap("checkpoint")
        result.checkpoint = {"folder": str(checkpoint.folder), "digest": checkpoint.manifest["digest"],
                             "generator_version": checkpoint.manifest["generator_version"],
                             "perturbed": checkpoint.manifest.get("perturbed")}
        is_model, is_train = case.op in MODEL_OPS, case.op in TRAIN_OPS
        if is_train and (o.repeat > 1 or tps or impls):
            raise CaseError(f"case {name!r}: --repeat, --versus-tp and --versus-impl are not implemented for "
                            "training cases")
        if is_train and o.refeed_ops and (ranked or case.train.dp > 1):
            raise CaseError(f"case {name!r}: --refeed re-runs one rank's training (dp = 1): give it without --dp, "
                            "--versus-dp or --versus-ep")
        if is_train:
            _check_expert_parallel(case, ranked)
        pair = started.pair = train.sides(case, checkpoint, ranked) if is_train else \
            orchestrate.pair_sides(case, checkpoint, tps, impls)
        truth = None if not is_model or case.dtype == "float64" else \
            train.truth_side(case, checkpoint) if is_train else model.truth_side(checkpoint)
        wants_truth = o.oracle and case.truth and "oracle" not in case.runners
        extra = [] if not wants_truth else [truth] if truth else [] if is_model else [oracle_side(checkpoint)]
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
                for run in range(2, runs + 1):
                    again = determinism.repeat_sides(first_round, pair, run)
                    with workers.fresh_processes(run > o.repeat):
                        result.sides += orchestrate.run_sides(case, again, o.device, run_dir, pythons, o.timeout)
            finally:  # this run's own workers end with this block: the oracle's round first, a signal's too
                if o.repeat > 1 and started.extras:
                    wait([started.extras])
        started.clock.lap("runners")
    except BaseException as error:  # every failure, the harness's own and a signal included: finish_case records it
        started.error = error
    return started


def finish_case(started: Started) -> tuple[CaseResult, Path]:
    """The second half: the oracle's round joined, comparisons, verdict, expectation, report (see ``start_case``)."""
    result, run_dir, o, case, pair = started.result, started.run_dir, started.options, started.case, started.pair
    tps, impls, ranked = started.versus
    try:
        extras = started.extras.result() if started.extras else []
        started.clock.lap("oracle")
        if started.error is not None:
            raise started.error
        result.sides[started.first_round:started.first_round] = extras  # a, b, the oracle, then repeats
        is_model, is_train = case.op in MODEL_OPS, case.op in TRAIN_OPS
        by_label = {side.label: side for side in result.sides}
        framework = [by_label["a"], by_label["b"]]
        skipped, refed = {}, None
        pythons = dict(o.pythons)
        if all(side.status == "ok" for side in framework):
            if is_train:  # step files, one step at a time (harness.compare.train)
                result.tensors, result.train = train.compare_steps(case, framework, by_label.get(ORACLE_LABEL))
                if ranked:  # which quantities stay bitwise, from which step each parts
                    result.comparison.update(train.invariance(result.train))
            elif is_model:
                result.tensors, result.harness["comparator_memory"], skipped = model.compare_outputs(case, framework)
            else:
                result.tensors, result.harness["comparator_memory"] = _compare_outputs(case, framework)
            result.first_divergence = first_divergence(result.tensors)
            if is_train and (o.refeed_ops or _float64_refeed(case, ranked)):  # re-feed in time: side b re-run from
                # side a's state, step by step (a float64 case's check judges every step by it)
                result.train["refeed"], refed = train_refeed.run(case, started.checkpoint, pair, framework,
                                                                 result.tensors, o.device, run_dir, pythons, o.timeout)
            elif o.refeed_ops and is_model:  # per-module re-feed: side a records, side b replays
                result.refeed = model_refeed.run(case, pair, result.tensors, o.device, run_dir, pythons, o.timeout)
            elif o.refeed_ops:
                result.refeed = refeed.run(case, started.checkpoint, framework, o.device, run_dir, pythons,
                                           o.timeout)
        if not is_train:  # a training run's truth is read per step, into result.train
            result.versus_oracle = (model.versus_truth if is_model else versus_oracle)(case, framework,
                                                                                        by_label.get(ORACLE_LABEL))
        result.repeats = determinism.self_consistency(case, result.sides, started.runs)
        result.tolerance = tolerance.judge(case.tolerance, result.tensors)
        result.verdict, result.message = decide(result.sides, result.tensors, determinism.unstable(result.repeats),
                                                result.tolerance)
        result.message += comparison_notes(result)
        if is_model and not is_train and result.tensors:
            result.model = model.summarise(case, result.tensors, skipped, model.idle_experts(case, framework))
        if is_model and case.dtype == "float64" and result.tensors:
            if is_train:
                _train_semantic_verdict(result, case, refed, _float64_refeed(case, ranked))
            else:
                _semantic_verdict(result, model.semantic_check(case, result.tensors, case.runners), result.model)
        if tps is None and impls is None and ranked is None:  # the expectation is about the case's runners; TP sizes,
            # levels or rank counts against each other: findings
            result.expectation = check_expectation(case.expect, result.verdict, result.tensors,
                                                   rank_departures(result.sides))
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


def _float64_refeed(case: Case, ranked) -> bool:
    """Whether a float64 training case's check gets its re-fed runs (they train one rank)."""
    return case.dtype == "float64" and ranked is None and case.train.dp == 1


def _train_semantic_verdict(result: CaseResult, case: Case, refed: dict | None, wanted: bool) -> None:
    """A float64 training case: every step judged (harness.compare.train_float64); a re-feed that failed or did not
    reproduce side b's own steps leaves the check unjudged past step 1: ERROR, saying so."""
    refeed = result.train.get("refeed") or {}
    if wanted and refeed.get("status") != "ok" and result.verdict in ("DIFF", "BITWISE_PASS"):
        result.verdict = ERROR
        result.message = (f"float64 check of every step could not judge steps 2 on: re-feed {refeed.get('status')}: "
                          f"{refeed.get('reason')}")
        return
    _semantic_verdict(result, train_float64.check(case, result.tensors, refed), result.train)


def _semantic_verdict(result: CaseResult, check: dict, summary: dict) -> None:
    """In float64 the sides must agree to ~1e-10 (model.semantic_check): beyond it is a mapping error (ERROR), within
    it the rounding differences are no finding (WITHIN_TOLERANCE); never a numeric DIFF. `summary`: where the check
    is kept (the model's or the training run's summary)."""
    summary["semantic"] = check
    if result.verdict not in ("DIFF", "BITWISE_PASS"):
        return
    if not check["ok"]:
        beyond = check["tensors_beyond"][0]
        where = (f"step {check['first_step']}, tensor {check['first_mismatch']} ({check['judged_by']})"
                 if check.get("first_step") else f"{check['first_mismatch']} (module {check['first_module']})")
        result.verdict = ERROR
        result.message = (f"float64 semantic check failed: mapping error at {where}: relative error "
                          f"{beyond['relative_error']:.3g} > {beyond['limit']:.0e}; {len(check['tensors_beyond'])} "
                          "tensor(s) beyond (first 20 listed)")
    elif result.verdict == "DIFF" and not rank_departures(result.sides):  # a rank's departure is no rounding
        result.verdict = "WITHIN_TOLERANCE"
        floors = check["floors"]
        stated = (f", or the float32 floor a framework states for {len(floors)} of them (up to "
                  f"{max(floors.values()):.0e})") if floors else ""
        parts = "".join(f"; {part['judged_by']}: {part['checked']}" for part in check.get("parts", []))
        result.message = (f"float64 semantic check passed: all {check['checked']} tensors{parts}, agree to relative "
                          "error "
                          f"{check['max_relative_error']:.3g} at most, each within its limit ({check['agreement']:.0e}"
                          f"{stated}) (bits differ: {result.message})")


def _with_steps_kept(case: Case, text: str) -> Case:
    """The case with ``--steps-kept`` over its train.steps_kept (a training case only)."""
    train = case.train
    if train is None:
        raise CaseError(f"case {case.name!r}: --steps-kept is for training cases (op causal_lm_train)")
    try:
        kept = parse_steps_kept(text, train.steps)
    except ValueError as error:
        raise CaseError(f"case {case.name!r}: {error}") from None
    return case.with_train(replace(train, steps_kept=tuple(kept)))


RANK_KINDS = {"dp": "data_parallel", "ep": "expert_parallel"}


def _with_ranks(case: Case, dp: int | None, ep: int | None) -> Case:
    """The training case at ``--dp`` / ``--ep`` ranks (validated as the case file's train.dp / train.ep are)."""
    if case.op not in TRAIN_OPS:
        raise CaseError(f"{case.source}: case {case.name!r}: --dp and --ep are for training cases (op "
                        f"{', '.join(TRAIN_OPS)}; got {case.op!r})")
    train_ = case.train
    ranked = with_ranks(train_, case.config["model"], train_.dp if dp is None else dp,
                        train_.ep if ep is None else ep, _ranks_error(case, "--dp / --ep"))
    return case.with_train(ranked)


def _check_expert_parallel(case: Case, ranked: tuple[dict, dict] | None) -> None:
    """Refuse a side at ep > 1 whose runner has no expert-parallel MoE layer, before anything starts."""
    for runner, sizes in zip(case.runners, ranked or ({"dp": case.train.dp, "ep": case.train.ep},) * 2, strict=True):
        if sizes["ep"] > 1 and runner not in EXPERT_PARALLEL_RUNNERS:
            raise CaseError(f"{case.source}: case {case.name!r}: train.ep = {sizes['ep']}: runner {runner!r} has no "
                            f"expert-parallel MoE layer (expert parallel runs on {', '.join(EXPERT_PARALLEL_RUNNERS)})")


def _ranks_error(case: Case, option: str):
    return lambda field, problem, value: CaseError(f"{case.source}: case {case.name!r}: {option}: train.{field} "
                                                   f"{problem} (got {value!r})")


def _versus_ranks(case: Case, kind: str, size: int, runner: str) -> tuple[Case, tuple[dict, dict]]:
    """One runner at the case's dp and ep (side a) against itself with `kind` ("dp" or "ep") at `size` (side b)."""
    option = f"--versus-{kind}"
    if case.op not in TRAIN_OPS:
        raise CaseError(f"{case.source}: case {case.name!r}: {option} is for training cases (op "
                        f"{', '.join(TRAIN_OPS)}; got {case.op!r})")
    if runner not in RUNNERS:
        raise CaseError(f"{case.source}: case {case.name!r}: --runner must be one of {', '.join(RUNNERS)} "
                        f"(got {runner!r})")
    train_ = case.train
    a = {"dp": train_.dp, "ep": train_.ep}
    b = {**a, kind: size}
    with_ranks(train_, case.config["model"], b["dp"], b["ep"], _ranks_error(case, option))
    if a == b:
        raise CaseError(f"{case.source}: case {case.name!r}: {option} {size} is side a's {kind} already (train.{kind}"
                        f" = {size}); give side a another with --{kind}")
    return replace(case, runners=(runner, runner), perturb=None), (a, b)


def describe_case(case: Case) -> dict:
    described = asdict(case)
    described["source"] = str(case.source)
    return described


def _versus_tp(case: Case, versus_tp: int, runner: str) -> tuple[Case, tuple[int, int]]:
    where = f"{case.source}: case {case.name!r}"
    if versus_tp not in TP_SIZES:
        raise CaseError(f"{where}: --versus-tp must be one of {', '.join(map(str, TP_SIZES))} (got {versus_tp!r})")
    if runner not in RUNNERS:
        raise CaseError(f"{where}: --runner must be one of {', '.join(RUNNERS)} (got {runner!r})")
    # at TP=1 the runners get sequence_parallel off (harness.run.orchestrate), so only TP > 1 must split the tokens
    case.check_tp(versus_tp, case.tokens, case.config if versus_tp > 1 else {})
    return replace(case, runners=(runner, runner), perturb=None), (case.tp, versus_tp)


PADDLE = "paddle"


def _versus_impl(case: Case, level: str) -> tuple[Case, tuple[str, str]]:
    where = f"{case.source}: case {case.name!r}"
    choices = KNOBS["paddle_impl"].choices
    if level not in choices:
        raise CaseError(f"{where}: --versus-impl must be one of {', '.join(choices)} (got {level!r})")
    if case.op in MODEL_OPS:
        raise CaseError(f"{where}: --versus-impl compares the op-level Paddle runner's implementation levels; op "
                        f"{case.op!r} runs a whole model")
    level_a = case.config["paddle_impl"]
    if level == level_a:
        raise CaseError(f"{where}: --versus-impl {level!r} is side a's level already (config.paddle_impl); give side "
                        "a another with --paddle-impl")
    return replace(case, runners=(PADDLE, PADDLE), perturb=None), (level_a, level)


def comparison_notes(result: CaseResult) -> str:
    """What the reader must know beyond the verdict: which tensors one runner keeps bitwise across TP sizes or
    implementation levels (ranks that disagree are the verdict's: harness.compare.result.rank_departures)."""
    notes = []
    if result.comparison and result.tensors:
        c = result.comparison
        equal = [t.name for t in result.tensors if t.status == "EQUAL"]
        differ = [t.name for t in result.tensors if t.status != "EQUAL"]
        if c["kind"] == "paddle_impl":
            c["equal"], c["differ"] = equal, differ
            notes.append(f"{c['runner']} at {c['impl_a']} vs {c['impl_b']}: bitwise equal: "
                         f"{', '.join(equal) or 'none'}; differ: {', '.join(differ) or 'none'}")
        elif c["kind"] in RANK_KINDS.values():
            kind = "dp" if c["kind"] == "data_parallel" else "ep"
            departs = ", ".join(f"{q} at step {k}" for q, k in c["departs"].items())
            notes.append(f"{c['runner']} {kind.upper()}={c[kind + '_a']} vs {kind.upper()}={c[kind + '_b']}: "
                         f"bitwise at every step: {', '.join(c['bitwise']) or 'none'}; departs: {departs or 'none'}")
        else:
            c["tp_invariant"], c["not_tp_invariant"] = equal, differ
            notes.append(f"{c['runner']} TP={c['tp_a']} vs TP={c['tp_b']}: bitwise TP-invariant: "
                         f"{', '.join(equal) or 'none'}; not: {', '.join(differ) or 'none'}")
    refeed = result.train.get("refeed") or {}
    if refeed.get("status") == "unfaithful":
        notes.append(f"re-feed in time not faithful ({refeed['reason']}): its attribution is not evidence")
    return "".join(f"; {note}" for note in notes)


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


def _compare_outputs(case: Case, sides) -> tuple[list, dict]:
    """The case's output tensors, loaded one pair at a time; and the comparator's peak memory."""
    a, b = (Dump(side.outputs, {spec.name: side.outputs for spec in case.output_specs()}) for side in sides)
    return compare_dumps(a, b)
