"""One comparison, start to finish: case -> checkpoint -> runners -> comparator -> report.

Whatever goes wrong (a bad case file, a corrupted checkpoint, a crashing or hanging runner), the run
ends with a report in its own new folder and an ERROR verdict that says why.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, replace
from pathlib import Path

from harness import __version__
from harness.case import checkpoints
from harness.case.registry import CASES_DIR, RUNNERS, TP_SIZES, Case, CaseError, Registry
from harness.commands import failsafe
from harness.commands.run_folder import REPORTS_DIR, new_run_dir, now
from harness.compare import determinism, refeed, tolerance
from harness.compare.dumps import Dump, compare_dumps
from harness.compare.result import ORACLE_LABEL, CaseResult, check_expectation, decide, first_divergence
from harness.compare.versus_oracle import oracle_side, versus_oracle
from harness.report import case_report as report
from harness.run import orchestrate, shards
from harness.run.protocol import host_provenance


def compare_case(name: str, *, device: str = "cpu", tokens: int | None = None, cases_dir: Path = CASES_DIR,
                 checkpoints_dir: Path = checkpoints.CHECKPOINTS_DIR, reports_dir: Path = REPORTS_DIR,
                 pythons: dict[str, str] | None = None, timeout: float = 1800.0,
                 weights_file: str | None = None, runners: tuple[str, str] | None = None,
                 versus_tp: int | None = None, runner: str | None = None, tp: int | None = None,
                 oracle: bool = True, repeat: int = 1, config_overrides: dict | None = None,
                 refeed_ops: bool = False) -> tuple[CaseResult, Path]:
    """Compare the case's two runners (or `runners`, ``--runners A,B``) at its TP size (or `tp`); with
    `versus_tp`, one runner (`runner`, default the case's first) at that TP size (side a) against itself at
    `versus_tp` (side b), on the same checkpoint. `oracle`: also run the truth oracle and measure each side's
    distance from it (skipped when a side already is the oracle); `repeat`: run each side that many times and
    check it agrees with itself. `config_overrides`: knobs set over the case's (the gate matrix);
    `refeed_ops`: for multi-op blocks, re-run each op on side b from side a's tensors."""
    run_id, run_dir = new_run_dir(Path(reports_dir), name)
    result = CaseResult(run_id=run_id, case_name=name, device=device, started_at=now(),
                        harness={"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                                 "host": host_provenance(), "node": platform.node()})
    try:
        case = _load_case(name, cases_dir, tokens, device, runners)
        case = case.with_tp(tp) if tp is not None else case
        if config_overrides:
            case = replace(case, config={**case.config, **config_overrides})
        tps = None
        if versus_tp is not None:
            case, tps = _versus_tp(case, versus_tp, runner or case.runners[0])
            result.comparison = {"kind": "tensor_parallel", "runner": case.runners[0], "tp_a": tps[0], "tp_b": tps[1]}
        result.case = describe_case(case)
        checkpoint = checkpoints.prepare(case, Path(checkpoints_dir), weights_file)
        result.checkpoint = {"folder": str(checkpoint.folder), "digest": checkpoint.manifest["digest"],
                             "generator_version": checkpoint.manifest["generator_version"],
                             "perturbed": checkpoint.manifest.get("perturbed")}
        pair = orchestrate.pair_sides(case, checkpoint, tps)
        extra = [oracle_side(checkpoint)] if oracle and "oracle" not in case.runners else []
        result.sides = orchestrate.run_sides(case, pair + extra, device, run_dir, pythons or {}, timeout)
        first_round = list(result.sides)
        for run in range(2, repeat + 1):
            again = determinism.repeat_sides(first_round, pair, run)
            result.sides += orchestrate.run_sides(case, again, device, run_dir, pythons or {}, timeout)
        by_label = {side.label: side for side in result.sides}
        framework = [by_label["a"], by_label["b"]]
        if all(side.status == "ok" for side in framework):
            result.tensors, result.harness["comparator_memory"] = _compare_outputs(case, framework)
            result.first_divergence = first_divergence(result.tensors)
            if refeed_ops:
                result.refeed = refeed.run(case, checkpoint, framework, device, run_dir, pythons or {}, timeout)
        result.versus_oracle = versus_oracle(case, framework, by_label.get(ORACLE_LABEL))
        result.repeats = determinism.self_consistency(case, result.sides, repeat)
        result.tolerance = tolerance.judge(case.tolerance, result.tensors)
        result.verdict, result.message = decide(result.sides, result.tensors, determinism.unstable(result.repeats),
                                                result.tolerance)
        result.message += tp_notes(result)
        if tps is None:  # a case's expectation is about its two runners; TP invariance is a finding, not a contract
            result.expectation = check_expectation(case.expect, result.verdict, result.tensors)
    except BaseException as error:  # every failure, the harness's own and a signal included: a verdict, a report
        failsafe.record(result, error)
    failsafe.finish(result, run_dir, report.write)
    return result, run_dir


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
    split = case.shapes[case.op_spec.tp_split_field]
    if split % versus_tp or (versus_tp > 1 and case.config.get("sequence_parallel") and case.tokens % versus_tp):
        raise CaseError(f"{where}: --versus-tp {versus_tp} does not divide shapes.{case.op_spec.tp_split_field}="
                        f"{split} (or the tokens, with sequence_parallel)")
    return replace(case, runners=(runner, runner), perturb=None), (case.tp, versus_tp)


def tp_notes(result: CaseResult) -> str:
    """What the reader must know about tensor parallelism beyond the verdict: TP invariance, ranks that disagree."""
    notes = []
    if result.comparison and result.tensors:
        c = result.comparison
        invariant = [t.name for t in result.tensors if t.status == "EQUAL"]
        variant = [t.name for t in result.tensors if t.status != "EQUAL"]
        c["tp_invariant"], c["not_tp_invariant"] = invariant, variant
        notes.append(f"{c['runner']} TP={c['tp_a']} vs TP={c['tp_b']}: bitwise TP-invariant: "
                     f"{', '.join(invariant) or 'none'}; not: {', '.join(variant) or 'none'}")
    for side in result.sides:
        differing = shards.inconsistent(side.meta.get("gather", {}))
        if differing:
            notes.append(f"side {side.label}: replicated {', '.join(differing)} differ between ranks "
                         "(rank 0's copy compared)")
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
