"""The nightly run: every case of the registry for one device, in one run directory, with a trend.

``reports/nightly-<YYYYmmdd-HHMMSS>-<suffix>/`` holds each case's own run folder under ``cases/`` plus
``report.json`` (schema-versioned, every case's result embedded, its tensor records cut to what the night's readers
use: ``nightly_keep.night_result``), ``report.md``, ``report.html`` and
``junit.xml``. A case passes when it did what it expects (exit code 0), is skipped when a framework lacks a
kernel or package here (UNSUPPORTED) or it needs a weights file nobody gave, and fails otherwise; the night
exits nonzero when any case fails, so a platform limit never hides a regression and never fakes one. Where
``baselines/`` holds the known verdicts of a case's platform, the case is judged against them
(``harness.baselines.records``): a known difference passes, a change fails, and a case the baseline ran that is
UNSUPPORTED or not run tonight fails. Each failed case says why (ERROR, unmet expectation, changed against the
baseline, lost, or "differs, no baseline": accepted with ``baseline update``). A shard (``--shard``) is judged
only together with the other shards, by ``nightly-merge``: alone it exits 0 once it has written its run directory.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import __version__, pipeline
from harness.baselines import records, store, trend
from harness.case.checkpoints import CHECKPOINTS_DIR
from harness.case.registry import RUNNERS, Case, Registry
from harness.case.select import SELECT_HELP, select
from harness.commands import doctor, nightly_keep, nightly_shards
from harness.compare.result import ERROR, UNSUPPORTED, CaseResult
from harness.levels import level_of
from harness.pipeline import failsafe, run_folder
from harness.report import junit, nightly_report
from harness.run import placement
from harness.run import workers as runner_workers
from harness.run.protocol import host_provenance

NIGHTLY_SCHEMA = 1
PREFIX = "nightly-"
EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


class NightlyError(ValueError):
    """A nightly run that cannot start (bad registry or previous report); the message says which file."""


def add_parser(commands) -> None:
    parser = commands.add_parser("nightly", help="run every case for a device; one run directory with a trend")
    add_run_arguments(parser)
    parser.add_argument("-k", dest="select", metavar="EXPRESSION", help=SELECT_HELP + " (a night of a few cases; "
                        "the baseline judges those, the cases it leaves out are listed, never failed)")
    parser.add_argument("--baselines", type=Path, default=store.BASELINES_DIR,
                        help="folder of known verdicts per platform (README: Known verdicts); default: baselines/")
    parser.add_argument("--no-baselines", dest="baselines", action="store_const", const=None,
                        help="judge every case by its own expectation only")


def add_run_arguments(parser) -> None:
    """What a night runs (shared with `baseline record`, which runs one)."""
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--tokens", type=int, help="token count for every case (e.g. 16 for CI on a CPU)")
    parser.add_argument("--previous", type=Path,
                        help="previous nightly run directory or its report.json (default: the newest one "
                             "for this device under --reports)")
    parser.add_argument("--python", action="append", default=[], metavar="RUNNER=PATH",
                        help="interpreter for a runner (or set HARNESS_PYTHON_<RUNNER>)")
    parser.add_argument("--timeout", type=failsafe.seconds, default=1800.0,
                        help="seconds per runner before it is killed")
    parser.add_argument("--weights", help="safetensors file for cases that import their weights")
    parser.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)
    parser.add_argument("--checkpoints", type=Path, default=CHECKPOINTS_DIR)
    parser.add_argument("--fresh-process", action="store_true", help=pipeline.FRESH_PROCESS_HELP)
    parser.add_argument("--keep", action="store_true",
                        help="keep every case's tensor files (default: only those of the cases the night fails)")
    nightly_shards.add_arguments(parser)


def main(args, pythons: dict[str, str]) -> int:
    try:
        night, run_dir = run_from_args(args, pythons, args.baselines)
    except NightlyError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print_summary(night, run_dir)
    _github_output(run_dir, night["exit_code"])
    return night["exit_code"]


def run_from_args(args, pythons: dict[str, str], baselines_dir: Path | None) -> tuple[dict, Path]:
    """`run` with the command line's options (NightlyError for bad input)."""
    if args.tokens is not None and args.tokens <= 0:
        raise NightlyError(f"--tokens must be a positive integer (got {args.tokens})")
    options = pipeline.CompareOptions(device=args.device, tokens=args.tokens, cases_dir=args.cases,
                                      reports_dir=args.reports, checkpoints_dir=args.checkpoints, pythons=pythons,
                                      timeout=args.timeout, weights_file=args.weights,
                                      fresh_process=args.fresh_process)
    return run(options, previous=args.previous, workers=args.workers, shard=args.shard, baselines_dir=baselines_dir,
               expression=getattr(args, "select", None), cells_per_gpu=args.cells_per_gpu, keep=args.keep)


def print_summary(night: dict, run_dir: Path) -> None:
    s = night["summary"]
    merged = f" (merged from {len(night['merged_from'])} shards)" if night.get("merged_from") else ""
    print(f"nightly {night['run_id']}{merged}: {s['failed']} failed, {s['passed']} passed, {s['skipped']} skipped; "
          f"report: {run_dir / 'report.md'} (exit code {night['exit_code']})")
    for line in nightly_report.summary_lines(night, run_dir):
        print(line)


def runners_used(cases: list[Case], options: pipeline.CompareOptions) -> list[str]:
    """The runners a night of `cases` starts (the doctor asks only these: probing the others cost about 10 CPU s a
    night and said nothing about its verdicts): each case's pair, or the pair `options` pins, and its truth (the
    oracle beside an op, the float64 model beside a model case), in the doctor's order."""
    used = set(options.runners or ())
    for case in cases:
        used.update(() if options.runners else case.runners)
        if options.oracle and case.truth:
            used.add(level_of(case).truth_runner)
    return [runner for runner in RUNNERS if runner in used]


def run(options: pipeline.CompareOptions, previous: Path | None, workers: int = 1,
        shard: tuple[int, int] | None = None, baselines_dir: Path | None = None,
        expression: str | None = None, cells_per_gpu: int = 1, keep: bool = False) -> tuple[dict, Path]:
    """Every case of `options.device` (at `options.tokens` when given), each in its own folder under the night's;
    or shard i of n of them (``shard=(i, n)``: every n-th case from the i-th); `workers` cells at a time, up to
    `cells_per_gpu` of them on one GPU; judged against the platform's baseline in `baselines_dir` when there is one
    (harness.baselines.records); only the cases `expression` picks when given (``-k``, as ``list -k``). Each case is
    judged as soon as it ends, and its tensor files go unless the night fails it or `keep` (nightly_keep)."""
    device, tokens, cases_dir, reports_dir = options.device, options.tokens, options.cases_dir, options.reports_dir
    try:
        cases = select(Registry.load(Path(cases_dir)).for_device(device), expression)
    except ValueError as error:
        raise NightlyError(str(error)) from None
    if not cases:
        raise NightlyError(f"-k {expression!r} picks none of the {device} cases in {cases_dir}")
    positions = {case.name: index for index, case in enumerate(cases)}
    cases = nightly_shards.select(cases, shard)
    previous_night = load_previous(previous) if previous else find_previous(Path(reports_dir), device)
    known = load_baselines(baselines_dir)
    run_id, run_dir = new_nightly_dir(Path(reports_dir))
    night = {"schema": NIGHTLY_SCHEMA, "kind": "nightly", "run_id": run_id, "device": device, "tokens": tokens,
             "cases_dir": str(cases_dir), "started_at": run_folder.now(), "finished_at": "",
             "harness": {"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                         "host": host_provenance(), "node": platform.node()},
             "previous_report": previous_night.get("_path") if previous_night else None,
             "workers": workers, "cells_per_gpu": cells_per_gpu, "shard": nightly_shards.describe(shard, cases),
             "select": expression}
    # What each runner the night uses would run here, asked before the cases (doctor.json): the verdicts are about it.
    (run_dir / "doctor.json").write_text(json.dumps(doctor.run(device, dict(options.pythons),
                                                               runners=runners_used(cases, options)),
                                                    indent=2, default=str) + "\n")
    night["doctor"] = "doctor.json"
    by_platform = None if baselines_dir is None else {records.platform_id(b["platform"]): b for b in known}
    with _Reporter(len(cases)) as progress:
        def one(case: Case) -> dict:
            progress.start(case.name)
            entry = _run_case(case, run_dir, replace(options, reports_dir=run_dir / "cases", keep_tensors=keep))
            entry["position"] = positions[case.name]  # in the registry's order: shards merge back into it
            entry["platform"] = records.platform(night["harness"]["host"], device,
                                                  (entry["result"] or {}).get("sides", []))
            judged = judge_now(entry, by_platform)
            if entry["run_dir"] and not keep:  # an UNSUPPORTED case compared no tensor: it fails on its reason
                entry["kept"] = _prune(entry, judged["outcome"] == "fail", entry["verdict"] != UNSUPPORTED, run_dir,
                                       options)
            progress.done(entry, judged)
            return entry

        with runner_workers.fresh_processes(options.fresh_process), runner_workers.serving(run_dir / "workers"):
            entries = placement.run_cells(cases, one, workers=workers, device=device, cells_per_gpu=cells_per_gpu,
                                          tp_of=lambda case: level_of(case).ranks(case),
                                          on_error=lambda case, error: _placement_failure(case, error, positions))
    night["cases"] = entries
    night["finished_at"] = run_folder.now()
    finish(night, previous_night, None if shard or baselines_dir is None else known, str(baselines_dir))
    write(night, run_dir)
    return night, run_dir


def finish(night: dict, previous_night: dict | None, known: list[dict] | None, source: str) -> None:
    """Judge a night that ran (or was merged): against the baselines of its platforms when `known` is given (a
    shard is judged only with the others, after `nightly-merge`), then its summary, exit code and trend."""
    entries = night["cases"]
    if known is not None:
        night["baseline"] = records.apply(night, known, source)
    for entry in entries:
        entry["failure"] = records.failure_kind(entry)
    counts = {outcome: sum(e["outcome"] == outcome for e in entries) for outcome in ("pass", "fail", "skip")}
    failed_by = {kind: sum(e["failure"] == kind for e in entries) for kind in records.FAILURE_KINDS}
    night["summary"] = {"total": len(entries), "passed": counts["pass"], "failed": counts["fail"],
                        "skipped": counts["skip"], "failed_by": {k: n for k, n in failed_by.items() if n}}
    # a shard's cases are judged with the other shards' (nightly-merge): alone, it fails nothing
    night["exit_code"] = EXIT_FAILED if counts["fail"] and not night.get("shard") else 0
    night["trend"] = trend.compare(previous_night, night)


def load_baselines(baselines_dir: Path | None) -> list[dict]:
    try:
        return store.load_all(baselines_dir)
    except store.BaselineError as error:
        raise NightlyError(str(error)) from None


def write(night: dict, run_dir: Path) -> None:
    """report.json on one line (a reader is a program: indenting a night's tensor records made it 1.7 times the size;
    ``jq . report.json`` shows it indented), report.md, report.html, junit.xml."""
    (run_dir / "report.json").write_text(json.dumps(night, default=str) + "\n")
    nightly_report.write(night, run_dir)
    junit.write(night, run_dir / "junit.xml")


def new_nightly_dir(root: Path) -> tuple[str, Path]:
    """``nightly-<timestamp>-<suffix>``: sorts by time, never reuses a folder."""
    return run_folder.new_run_dir(root, prefix=PREFIX)


def find_previous(reports_dir: Path, device: str) -> dict | None:
    """The newest complete nightly report for this device under ``reports_dir`` (unreadable ones are passed over)."""
    if not reports_dir.is_dir():
        return None
    for folder in sorted(reports_dir.glob(f"{PREFIX}*"), reverse=True):
        try:
            night = load_previous(folder)
        except NightlyError:
            continue
        if night["device"] == device and not night.get("shard"):  # a shard is part of a night, not one
            return night
    return None


def load_previous(path: Path) -> dict:
    file = path / "report.json" if path.is_dir() else path
    try:
        night = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise NightlyError(f"{file}: cannot read a previous nightly report: {error}") from None
    if not isinstance(night, dict) or night.get("kind") != "nightly" or night.get("schema") != NIGHTLY_SCHEMA:
        found = (night.get("kind"), night.get("schema")) if isinstance(night, dict) else type(night).__name__
        raise NightlyError(f"{file}: field 'kind'/'schema': not a nightly report of schema {NIGHTLY_SCHEMA} "
                           f"(got {found!r})")
    night["_path"] = str(file)
    return night


def _run_case(case: Case, run_dir: Path, options: pipeline.CompareOptions) -> dict:
    entry = {"case": case.name, "family": case.family, "expected": case.expect.verdict, "verdict": None,
             "exit_code": None, "problems": [], "wall_seconds": 0.0, "run_dir": None, "report": None, "result": None}
    if case.weights_from and not (options.weights_file or case.weights_from.file):
        return {**entry, "outcome": "skip", "message": "not run: takes its weights from a file (--weights FILE)"}
    start = time.perf_counter()
    try:
        result, case_dir = pipeline.compare_case(case.name, options)
    except Exception as error:  # one case's harness crash must not lose the rest of the night
        return {**entry, "outcome": "fail", "verdict": ERROR, "message": f"harness crashed: {error!r}",
                "wall_seconds": round(time.perf_counter() - start, 3)}
    return {**entry, "outcome": outcome(result), "verdict": result.verdict, "exit_code": result.exit_code,
            "message": result.message, "problems": result.expectation.get("problems", []),
            "wall_seconds": round(time.perf_counter() - start, 3), "run_dir": str(case_dir.relative_to(run_dir)),
            "report": str((case_dir / "report.md").relative_to(run_dir)),
            "result": nightly_keep.night_result(result.to_dict())}


def judge_now(entry: dict, by_platform: dict[str, dict] | None) -> dict:
    """The case as the night will judge it (``finish`` applies the same baseline to the whole night; a shard's
    merge, to the shards): its outcome and baseline status, the moment it ends."""
    if by_platform is None:
        return {"outcome": entry["outcome"], "status": None}
    return records.judge_case(entry, by_platform.get(records.platform_id(entry["platform"])))


def _prune(entry: dict, failed: bool, compared: bool, run_dir: Path, options: pipeline.CompareOptions) -> dict:
    """Tensor files kept only of a failed case that compared them; the report of a case that did not fail, compressed
    (nightly_keep)."""
    case_dir = run_dir / entry["run_dir"]
    kept = nightly_keep.prune(case_dir, failed and compared, (entry["result"] or {}).get("first_divergence"))
    if not failed:
        kept.update(nightly_keep.compress_report(case_dir))
    kept["rerun"] = nightly_keep.rerun_command(entry["case"], options.device, options.tokens, options.weights_file)
    nightly_keep.note(case_dir / "report.md", kept, kept["rerun"])
    return kept


def _placement_failure(case: Case, error: Exception, positions: dict[str, int]) -> dict:
    return {"case": case.name, "family": case.family, "expected": case.expect.verdict, "verdict": ERROR,
            "exit_code": None, "problems": [], "wall_seconds": 0.0, "run_dir": None, "report": None, "result": None,
            "outcome": "fail", "message": f"not run: {error}", "position": positions[case.name]}


def outcome(result: CaseResult) -> str:
    if result.exit_code == 0:
        return "pass"
    return "skip" if result.verdict == UNSUPPORTED else "fail"


class _Reporter:
    """A rich progress bar on a terminal; one plain line per case in CI or when output is not a terminal."""

    def __init__(self, total: int):
        self.total, self.count, self.finished = total, 0, 0
        self.bar = None
        if Console().is_terminal and not os.environ.get("CI"):
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn())
            self.task = self.bar.add_task("nightly", total=total)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def start(self, name: str) -> None:
        self.count += 1
        if self.bar:
            self.bar.update(self.task, description=f"[{self.count}/{self.total}] {name}")
        else:
            print(f"[nightly {self.count}/{self.total}] {name}: running", flush=True)

    def done(self, entry: dict, judged: dict) -> None:
        """The night's judgment first (the baseline's status beside it), then the raw verdict and its own outcome."""
        self.finished += 1
        status = f" [baseline: {judged['status']}]" if judged["status"] else ""
        raw = f"verdict {entry['verdict']}, own expectation {entry['outcome']}, " if entry["verdict"] else ""
        line = (f"[nightly {self.finished}/{self.total}] {entry['case']}: {judged['outcome'].upper()}{status} "
                f"({raw}{entry['wall_seconds']:.1f} s) {entry['message']}")
        if self.bar:
            self.bar.console.print(line, highlight=False, markup=False)
            self.bar.advance(self.task)
        else:
            print(line, flush=True)


def _github_output(run_dir: Path, exit_code: int) -> None:
    """In GitHub Actions, tell later steps where the run landed."""
    target = os.environ.get("GITHUB_OUTPUT")
    if target:
        with open(target, "a") as out:
            out.write(f"run_dir={run_dir}\nexit_code={exit_code}\n")

