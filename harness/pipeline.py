"""One comparison, start to finish: case -> checkpoint -> runners -> comparator -> report.

Whatever goes wrong (a bad case file, a corrupted checkpoint, a crashing or hanging runner), the run
ends with a report in its own new folder and an ERROR verdict that says why.
"""

from __future__ import annotations

import platform
import secrets
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from harness import __version__, checkpoints, orchestrate, refeed, report
from harness.cases import CASES_DIR, Case, CaseError, Registry
from harness.checkpoints import CheckpointError
from harness.compare import compare_tensor
from harness.result import ERROR, CaseResult, check_expectation, decide, first_divergence
from harness.runners.protocol import host_provenance

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
                 weights_file: str | None = None, config_overrides: dict | None = None,
                 refeed_ops: bool = False) -> tuple[CaseResult, Path]:
    run_id, run_dir = new_run_dir(Path(reports_dir), name)
    result = CaseResult(run_id=run_id, case_name=name, device=device, started_at=_now(),
                        harness={"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                                 "host": host_provenance(), "node": platform.node()})
    try:
        case = _load_case(name, cases_dir, tokens, device)
        if config_overrides:
            case = replace(case, config={**case.config, **config_overrides})
        result.case = describe_case(case)
        checkpoint = checkpoints.prepare(case, Path(checkpoints_dir), weights_file)
        result.checkpoint = {"folder": str(checkpoint.folder), "digest": checkpoint.manifest["digest"],
                             "generator_version": checkpoint.manifest["generator_version"],
                             "perturbed": checkpoint.manifest.get("perturbed")}
        result.sides = orchestrate.run_pair(case, checkpoint, device, run_dir, pythons or {}, timeout)
        if all(side.status == "ok" for side in result.sides):
            result.tensors = _compare_outputs(case, result.sides)
            result.first_divergence = first_divergence(result.tensors)
            if refeed_ops:
                result.refeed = refeed.run(case, checkpoint, result.sides, device, run_dir, pythons or {}, timeout)
        result.verdict, result.message = decide(result.sides, result.tensors)
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
