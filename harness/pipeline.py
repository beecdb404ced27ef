"""One comparison, start to finish: case -> checkpoint -> runners -> comparator -> report.

Whatever goes wrong (a bad case file, a corrupted checkpoint, a crashing or hanging runner), the run
ends with a report in its own new folder and an ERROR verdict that says why.
"""

from __future__ import annotations

import platform
import secrets
import sys
import time
from dataclasses import asdict
from pathlib import Path

from harness import __version__, checkpoints, determinism, orchestrate, report, tolerance
from harness.cases import CASES_DIR, Case, CaseError, Registry
from harness.checkpoints import CheckpointError
from harness.compare import compare_tensor
from harness.result import ERROR, ORACLE_LABEL, CaseResult, check_expectation, decide
from harness.runners.protocol import host_provenance
from harness.versus_oracle import oracle_side, versus_oracle

REPORTS_DIR = Path(__file__).resolve().parents[1] / "reports"


def new_run_dir(root: Path, label: str) -> tuple[str, Path]:
    """A fresh folder per run; existing runs are never touched."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:60] or "run"
    root.mkdir(parents=True, exist_ok=True)
    while True:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{secrets.token_hex(3)}"
        try:
            (root / run_id).mkdir()
            return run_id, root / run_id
        except FileExistsError:
            continue


def compare_case(name: str, *, device: str = "cpu", tokens: int | None = None, cases_dir: Path = CASES_DIR,
                 checkpoints_dir: Path = checkpoints.CHECKPOINTS_DIR, reports_dir: Path = REPORTS_DIR,
                 pythons: dict[str, str] | None = None, timeout: float = 1800.0,
                 weights_file: str | None = None, oracle: bool = True, repeat: int = 1) -> tuple[CaseResult, Path]:
    """`oracle`: also run the truth oracle and measure each side's distance from it (skipped when a side
    already is the oracle); `repeat`: run each side that many times and check it agrees with itself."""
    run_id, run_dir = new_run_dir(Path(reports_dir), name)
    result = CaseResult(run_id=run_id, case_name=name, device=device, started_at=_now(),
                        harness={"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                                 "host": host_provenance(), "node": platform.node()})
    try:
        case = _load_case(name, cases_dir, tokens, device)
        result.case = describe_case(case)
        checkpoint = checkpoints.prepare(case, Path(checkpoints_dir), weights_file)
        result.checkpoint = {"folder": str(checkpoint.folder), "digest": checkpoint.manifest["digest"],
                             "generator_version": checkpoint.manifest["generator_version"],
                             "perturbed": checkpoint.manifest.get("perturbed")}
        pair = orchestrate.pair_sides(case, checkpoint)
        extra = [oracle_side(checkpoint)] if oracle and "oracle" not in case.runners else []
        result.sides = orchestrate.run_sides(case, pair + extra, device, run_dir, pythons or {}, timeout)
        first_round = list(result.sides)
        for run in range(2, repeat + 1):
            again = determinism.repeat_sides(first_round, pair, run)
            result.sides += orchestrate.run_sides(case, again, device, run_dir, pythons or {}, timeout)
        by_label = {side.label: side for side in result.sides}
        framework = [by_label["a"], by_label["b"]]
        if all(side.status == "ok" for side in framework):
            result.tensors = _compare_outputs(case, framework)
        result.versus_oracle = versus_oracle(case, framework, by_label.get(ORACLE_LABEL))
        result.repeats = determinism.self_consistency(case, result.sides, repeat)
        result.tolerance = tolerance.judge(case.tolerance, result.tensors)
        result.verdict, result.message = decide(result.sides, result.tensors, determinism.unstable(result.repeats),
                                                result.tolerance)
        result.expectation = check_expectation(case.expect, result.verdict, result.tensors)
    except (CaseError, CheckpointError) as error:
        result.verdict, result.message = ERROR, str(error)
    result.finished_at = _now()
    report.write(result, run_dir)
    return result, run_dir


def describe_case(case: Case) -> dict:
    described = asdict(case)
    described["source"] = str(case.source)
    return described


def _load_case(name: str, cases_dir: Path, tokens: int | None, device: str) -> Case:
    case = Registry.load(Path(cases_dir)).get(name)
    if tokens is not None:
        case = case.with_tokens(tokens)
    if device not in case.devices:
        raise CaseError(f"{case.source}: case {name!r}: field 'devices': does not list {device!r} "
                        f"(got {list(case.devices)})")
    return case


def _compare_outputs(case: Case, sides) -> list:
    a, b = (checkpoints.load_tensors(side.outputs) for side in sides)
    return [compare_tensor(spec.name, a.get(spec.name), b.get(spec.name)) for spec in case.output_specs()]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
