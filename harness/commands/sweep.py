"""Sweeps: one case over several token counts (and runner pairs), reported as a matrix of tokens by tensors.

On a GPU the GEMM library picks kernels by shape and operand layout, so the same math can change bits at some
token counts and not at others; the matrix shows where. Each cell is an ordinary run
(``pipeline.compare_case``) with its own full report, in its own folder inside the sweep's folder; the sweep's
``report.json``, ``report.md`` and ``report.html`` hold the matrix, each cell's verdict and statistics, and
the provenance (rendered by ``harness.report.sweep_report``). Each runner stays up across the cells
(``harness.run.workers``) unless ``fresh_process`` is set, and a cell's oracle, comparisons and report are finished
while the next cell's framework sides run.
"""

from __future__ import annotations

import contextvars
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from harness import pipeline
from harness.compare.result import EXIT_CODES, CaseResult
from harness.pipeline import run_folder
from harness.report import sweep_report
from harness.report.sweep_report import console  # noqa: F401  (the CLI prints a sweep with sweep.console)
from harness.run import supervisor, workers

SWEEP_SCHEMA = 1
# Provenance keys worth repeating in the sweep report (each cell's report.json has all of them).
PROVENANCE_KEYS = ("implementation", "versions", "torch", "device", "gpu", "gpu_capability", "gpu_driver",
                   "cuda_runtime", "cudnn", "cublas", "cublasLt", "preferred_blas_library", "torch_cpu_capability",
                   "torch_blas", "torch_onednn", "determinism", "weight_layout")


def run_sweep(name: str, tokens: Sequence[int | None], pairs: Sequence[tuple[str, str] | None] = (None,),
              options: pipeline.CompareOptions = pipeline.DEFAULT_OPTIONS, *,
              progress: Callable[[str], None] | None = None) -> tuple[dict, Path]:
    """Run every (pair, tokens) cell; None is the case's own pair or token count. Returns the report and folder."""
    progress = progress or _print_progress
    sweep_id, sweep_dir = run_folder.new_run_dir(Path(options.reports_dir), f"sweep-{name}")
    started = run_folder.now()
    cells, total = [], len(tokens) * len(pairs)

    def finish(begun: pipeline.Started, pair, count: int, clock: float) -> None:
        result, run_dir = pipeline.finish_case(begun)
        cells.append(_cell(result, run_dir, pair, count, time.monotonic() - clock))
        cell = cells[-1]
        progress(f"[{len(cells)}/{total}] {name} {cell['pair']} tokens={count}: {cell['verdict']} "
                 f"({cell['wall_seconds']:.1f} s) {_diff_summary(cell)}".rstrip())

    # Pipelined: a cell's oracle, comparisons and report are finished in the background while the next cell's
    # checkpoint and framework sides run (one finisher thread: one cell finishing at a time, so cells end in order).
    # A started cell is handed to the finisher at once, before waiting on the cell before: whatever then stops the
    # sweep (a signal during the wait, the cell before failing to write its report), leaving the executor waits for
    # it, so it gets its report and its oracle's round ends before the workers do.
    with workers.fresh_processes(options.fresh_process), workers.serving(sweep_dir / "workers"), \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="sweep-finish") as finisher:
        finishing = None
        for pair, count in ((pair, count) for pair in pairs for count in tokens):
            if supervisor.interrupted():  # a signal stopped the cell before: start no other
                break
            clock = time.monotonic()
            begun = pipeline.start_case(name, replace(options, tokens=count, runners=pair, reports_dir=sweep_dir))
            before, finishing = finishing, finisher.submit(contextvars.copy_context().run, finish, begun, pair,
                                                           count, clock)
            if before is not None:
                before.result()  # the cell before: its report written
            if isinstance(begun.error, (supervisor.Interrupted, KeyboardInterrupt)):
                break  # stopped by a signal (without the command line's handlers too): start no other cell
        if finishing is not None:
            finishing.result()  # an interrupted cell re-raises here, once its report is written
    report = {"schema": SWEEP_SCHEMA, "kind": "sweep", "sweep_id": sweep_id, "case": name,
              "device": options.device, "tokens": list(tokens),
              "pairs": list(dict.fromkeys(cell["pair"] for cell in cells)),
              "tensors": list(dict.fromkeys(t for cell in cells for t in cell["tensors"])),
              "verdicts": dict(Counter(cell["verdict"] for cell in cells)), "exit_code": exit_code(cells),
              "argv": sys.argv, "started_at": started, "finished_at": run_folder.now(),
              "provenance": _provenance(cells), "cells": cells}
    (sweep_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    sweep_report.write(report, sweep_dir)
    return report, sweep_dir


def exit_code(cells: list[dict]) -> int:
    """ERROR beats an unmet expectation or a difference, which beat UNSUPPORTED; all cells 0 gives 0."""
    codes = {cell["exit_code"] for cell in cells}
    for code in (EXIT_CODES["ERROR"], EXIT_CODES["DIFF"], EXIT_CODES["UNSUPPORTED"]):
        if code in codes:
            return code
    return 0


def _cell(result: CaseResult, run_dir: Path, pair, tokens: int, wall: float) -> dict:
    runners = result.case.get("runners") or pair
    return {"pair": " vs ".join(runners) if runners else "the case's pair", "runners": list(runners or ()),
            "tokens": result.case.get("tokens", tokens), "verdict": result.verdict, "exit_code": result.exit_code,
            "message": result.message,
            "expectation_met": result.expectation.get("met"), "run_dir": run_dir.name,
            "wall_seconds": round(wall, 2), "sides": [side.to_dict() for side in result.sides],
            "tensors": {t.name: t.to_dict() for t in result.tensors}}


def _provenance(cells: list[dict]) -> dict:
    """Per runner, what the first cell it ran in says about it."""
    found = {}
    for cell in cells:
        for side in cell["sides"]:
            if side["runner"] not in found and side["meta"].get("implementation"):
                found[side["runner"]] = {k: side["meta"][k] for k in PROVENANCE_KEYS if k in side["meta"]}
                found[side["runner"]]["host"] = side["meta"].get("host", {}).get("cpu")
    return found


def _diff_summary(cell: dict) -> str:
    differing = [f"{name} {t['mismatches']}" for name, t in cell["tensors"].items() if t["status"] != "EQUAL"]
    return ("differ: " + ", ".join(differing)) if differing else ""


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
