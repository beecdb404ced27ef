"""``python -m harness compare-runs RUN_A RUN_B``: two training runs that were captured, not started here, compared as
the training level compares its own sides: the same per-step verdicts, first divergence in time, pictures, reports
and exit codes (docs/attach.md).

A run is a step folder (a built-in runner's side folder, or what a recorder in the user's own loop wrote:
``harness.attach``), or a loss-only run: the logs or the ``loss.json`` that PaddleFleet's ``compare_loss.py`` reads
(``harness.compare.loss_logs``). Both runs must be of one kind. ``--truth`` adds a float64 step folder (the training
level's truth side, or a float64 capture) and says per step which run is closer to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import __version__
from harness.compare import captured_runs, hook_dumps, loss_logs, module_steps, refed_runs, train_steps
from harness.compare.result import ORACLE_LABEL, CaseResult, decide, first_divergence
from harness.pipeline import describe_case, failsafe, run_folder
from harness.report import case_report as report
from harness.run.protocol import host_provenance


def add_parser(commands) -> None:
    parser = commands.add_parser("compare-runs", help="compare two captured training runs (step folders, or loss "
                                                      "logs / loss.json) step by step, bit for bit")
    parser.add_argument("a", type=Path, help="run A: a step folder (steps/ and meta.json), a log file or folder "
                                             "(per_token_loss / final_loss lines), or a loss.json")
    parser.add_argument("b", type=Path, help="run B, of the same kind")
    parser.add_argument("--truth", type=Path, help="step folders: a float64 run of the same steps (the training "
                                                   "level's truth side's folder); each step says which run is "
                                                   "closer to it")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="step folders: compare steps 1 to N of both runs (default: every step; runs of "
                             "different lengths are an ERROR)")
    parser.add_argument("--micro-batches", type=int, default=1, metavar="N",
                        help="loss logs: micro-batches per step on each rank (compare_loss.py's -m; default 1)")
    parser.add_argument("--losses-a", default="main", metavar="NAME,NAME",
                        help="loss logs: the losses run A prints per micro-batch, in its order (compare_loss.py's "
                             "--pf-loss-order, e.g. main,mtp; default main)")
    parser.add_argument("--losses-b", default=None, metavar="NAME,NAME",
                        help="loss logs: the same for run B (e.g. mtp,main; default: run A's)")
    parser.add_argument("--hook-dumps", action="store_true",
                        help="the runs are per-module md5 dumps ([DUMP PF] forward/grad lines: PaddleFleet's, or "
                             "harness.attach.dump_hooks'): name the first module that departs, per step, "
                             "micro-batch (--micro-batches) and rank")
    parser.add_argument("--name-map", type=Path, metavar="FILE",
                        help="hook dumps: a JSON or TOML table of 'module in A' = 'module in B' (default: the "
                             "same names)")
    parser.add_argument("--refed", type=Path, metavar="RUN",
                        help="step folders: run B's loop re-fed from run A's state after step k (python -m harness "
                             "state-for): which differences step k + 1 made and which it carried in")
    parser.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)


def main(args) -> int:
    result, run_dir = compare_runs(args.a, args.b, truth=args.truth, steps=args.steps,
                                   micro_batches=args.micro_batches,
                                   losses=(_names(args.losses_a), _names(args.losses_b or args.losses_a)),
                                   hook_dumps=args.hook_dumps, name_map=args.name_map, refed=args.refed,
                                   reports_dir=args.reports)
    report.console(result, run_dir)
    return result.exit_code


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def compare_runs(a: Path, b: Path, *, truth: Path | None = None, steps: int | None = None, micro_batches: int = 1,
                 losses: tuple[tuple[str, ...], tuple[str, ...]] = (("main",), ("main",)),
                 hook_dumps: bool = False, name_map: Path | None = None, refed: Path | None = None,
                 reports_dir: Path = run_folder.REPORTS_DIR) -> tuple[CaseResult, Path]:
    """The report of two captured runs, in a new run folder under `reports_dir`."""
    run_id, run_dir = run_folder.new_run_dir(Path(reports_dir), "compare-runs")
    inputs = {"a": str(a), "b": str(b), "truth": str(truth) if truth else None, "steps": steps,
              "hook_dumps": hook_dumps, "name_map": str(name_map) if name_map else None,
              "refed": str(refed) if refed else None}
    result = CaseResult(run_id=run_id, case_name=f"compare-runs {Path(a).name} {Path(b).name}", device="files",
                        started_at=run_folder.now(),
                        harness={"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                                 "host": host_provenance(), "inputs": inputs})
    try:
        for label, path in (("run A", a), ("run B", b), ("--truth", truth), ("--refed", refed)):
            if path is not None and not Path(path).exists():
                raise captured_runs.RunError(f"{label}: {path} does not exist")
        if name_map is not None and not hook_dumps:
            raise captured_runs.RunError("--name-map: for --hook-dumps runs")
        if refed is not None and not all(captured_runs.is_step_run(path) for path in (a, b, refed)):
            raise captured_runs.RunError("--refed: for step folders (runs A and B and the re-fed run)")
        kinds = [captured_runs.is_step_run(path) for path in (a, b)]
        if hook_dumps:
            if truth or steps is not None:
                raise captured_runs.RunError("--truth and --steps: for step folders, not --hook-dumps runs")
            _dump_runs(result, Path(a), Path(b), micro_batches, name_map)
        elif all(kinds):
            _step_runs(result, Path(a), Path(b), Path(truth) if truth else None, steps, Path(refed) if refed else None)
        elif not any(kinds):
            if truth:
                raise captured_runs.RunError("--truth: loss-only runs have no state to judge against a truth")
            if steps is not None:
                raise captured_runs.RunError("--steps: for step folders; loss-only runs are compared record by "
                                             "record")
            _loss_runs(result, Path(a), Path(b), micro_batches, losses)
        else:
            step, other = (a, b) if kinds[0] else (b, a)
            raise captured_runs.RunError(f"{step} is a step folder and {other} is not (a log or loss.json): compare "
                                         "two step folders, or two loss-only runs")
    except BaseException as error:  # every failure, the harness's own and a signal included: a verdict, a report
        failsafe.record(result, error)
    failsafe.finish(result, run_dir, report.write)
    return result, run_dir


def _step_runs(result: CaseResult, a: Path, b: Path, truth: Path | None, steps: int | None,
               refed: Path | None = None) -> None:
    runs = [captured_runs.read(path) for path in (a, b)]
    reference = captured_runs.read(truth) if truth else None
    for run in runs + ([reference] if reference else []):
        captured_runs.check(run)
    case, notes = captured_runs.comparison_case(*runs, truth=reference, steps=steps)
    pair = [run.side(label) for label, run in zip("ab", runs, strict=True)]
    for side, run in zip(pair, runs, strict=True):  # several ranks: each rank's state against rank 0's
        agree = captured_runs.ranks(run)
        if agree is not None:
            side.meta = {**side.meta, "ranks_agree": agree}
    truth_side = reference.side(ORACLE_LABEL) if reference else None
    result.case, result.sides = describe_case(case), pair + ([truth_side] if truth_side else [])
    result.device = " / ".join(dict.fromkeys(run.device for run in runs))
    result.tensors, result.train = train_steps.compare_steps(case, pair, truth_side)
    module_rows, modules, module_notes = module_steps.compare(*runs, reference, case.train.steps)
    result.tensors += module_rows
    result.first_divergence = first_divergence(result.tensors)
    result.verdict, result.message = decide(pair, result.tensors)
    if modules:
        result.train["modules"] = modules
        result.message += _first_module(modules)
    notes += module_notes + _not_computed(result.train)
    result.train["notes"] = notes
    result.message += "".join(f"; {note}" for note in notes)
    if refed is not None:
        result.train["refed"] = refed_runs.attribute(*runs, result.tensors, refed)
        result.message += refed_runs.line(result.train["refed"])


def _first_module(modules: dict) -> str:
    """The module outputs' line of the verdict: the first divergent module and which run the truth sides with."""
    first = modules["first_divergence"]
    steps = ", ".join(map(str, modules["steps"]))
    if first is None:
        return f"; module outputs bitwise equal at steps {steps}"
    truth = first["truth"]
    side = None if truth is None else "neither run" if truth["side"] == "neither" else f"run {truth['side']}"
    sides = "" if truth is None else (f"; at it the float64 truth sides with {side} (largest distance from it: run A "
                                      f"{truth['distance_a']:.3g}, run B {truth['distance_b']:.3g})")
    return (f"; first divergent module: {first['module']} ({first['quantity']}) at step {first['step']}, micro-batch "
            f"{first['micro_batch']} (module outputs captured at steps {steps}){sides}")


def _not_computed(summary: dict) -> list[str]:
    """A scalar a run did not write (a norm without clipping), named once with the steps it is missing from."""
    missing: dict[str, list[int]] = {}
    for step in summary["steps"]:
        for scalar, value in step["scalars"].items():
            if value["equal"] is None:
                missing.setdefault(f"{scalar} {value['note']}", []).append(step["step"])
    return [f"{what}: not compared (steps {', '.join(map(str, at))})" for what, at in missing.items()]


def _loss_runs(result: CaseResult, a: Path, b: Path, micro_batches: int, losses) -> None:
    runs = [loss_logs.read(path, micro_batches, names) for path, names in zip((a, b), losses, strict=True)]
    result.tensors, result.train = loss_logs.compare(*runs)
    result.first_divergence = first_divergence(result.tensors)
    result.verdict, result.message = decide([], result.tensors)
    result.message += f"; loss only ({runs[0].kind}): no gradient, optimizer state or parameter was captured"


def _dump_runs(result: CaseResult, a: Path, b: Path, micro_batches: int, name_map: Path | None) -> None:
    runs = hook_dumps.read_pair(a, b, micro_batches, name_map)
    result.tensors, result.train = hook_dumps.compare(*runs)
    result.first_divergence = first_divergence(result.tensors)
    result.verdict, result.message = decide([], result.tensors)
    first = result.train["first_divergence"]
    if first:
        result.message = (f"first divergent module: {first['module']} ({first['quantity']}) at step {first['step']}, "
                          f"micro-batch {first['micro_batch']}, rank {first['rank']}; {result.message}")
    result.message += f"; {hook_dumps.WHAT}: {hook_dumps.LACKS}"
