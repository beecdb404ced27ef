"""Sweeps: one case over several token counts (and runner pairs), reported as a matrix of tokens by tensors.

On a GPU the GEMM library picks kernels by shape and operand layout, so the same math can change bits at some
token counts and not at others; the matrix shows where. Each cell is an ordinary run
(``pipeline.compare_case``) with its own full report, in its own folder inside the sweep's folder; the sweep's
``report.json`` and ``report.md`` hold the matrix, each cell's verdict and statistics, and the provenance.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness.commands import compare as pipeline
from harness.commands import run_folder
from harness.compare.result import EXIT_CODES, CaseResult

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
    for pair in pairs:
        for count in tokens:
            clock = time.monotonic()
            result, run_dir = pipeline.compare_case(name, replace(options, tokens=count, runners=pair,
                                                                  reports_dir=sweep_dir))
            cells.append(_cell(result, run_dir, pair, count, time.monotonic() - clock))
            cell = cells[-1]
            progress(f"[{len(cells)}/{total}] {name} {cell['pair']} tokens={count}: {cell['verdict']} "
                     f"({cell['wall_seconds']:.1f} s) {_diff_summary(cell)}".rstrip())
    report = {"schema": SWEEP_SCHEMA, "kind": "sweep", "sweep_id": sweep_id, "case": name,
              "device": options.device, "tokens": list(tokens),
              "pairs": list(dict.fromkeys(cell["pair"] for cell in cells)),
              "tensors": list(dict.fromkeys(t for cell in cells for t in cell["tensors"])),
              "verdicts": dict(Counter(cell["verdict"] for cell in cells)), "exit_code": exit_code(cells),
              "argv": sys.argv, "started_at": started, "finished_at": run_folder.now(),
              "provenance": _provenance(cells), "cells": cells}
    (sweep_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (sweep_dir / "report.md").write_text(markdown(report))
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


def _matrix_cell(tensor: dict | None) -> str:
    if tensor is None:
        return "—"
    if tensor["status"] == "EQUAL":
        return "="
    if tensor["status"] == "DIFF":
        return f"{tensor['mismatches']} ({tensor['mismatch_share']:.2%}, max {tensor['max_ulp']} ULP)"
    return tensor["status"]


def markdown(report: dict) -> str:
    counts = ", ".join(f"{verdict} {n}" for verdict, n in sorted(report["verdicts"].items()))
    lines = [f"# Sweep: {report['case']} on {report['device']}", "",
             f"- sweep: `{report['sweep_id']}`, {report['started_at']} to {report['finished_at']}",
             f"- command: `{' '.join(report['argv'])}`",
             f"- cells: {len(report['cells'])} ({counts}); exit code {report['exit_code']}",
             "- a matrix cell: `=` bitwise equal; `N (share, max U ULP)`: N elements differ; `—`: no comparison "
             "(see the notes). Side a against side b; each cell's full report is `<run>/report.md`."]
    for pair in report["pairs"]:
        cells = [cell for cell in report["cells"] if cell["pair"] == pair]
        lines += ["", f"## {pair}", "", "| tokens | verdict | " + " | ".join(report["tensors"]) + " | wall s | run |",
                  "|---:|---|" + "---:|" * len(report["tensors"]) + "---:|---|"]
        for cell in cells:
            row = [_matrix_cell(cell["tensors"].get(name)) for name in report["tensors"]]
            lines.append(f"| {cell['tokens']} | {cell['verdict']} | " + " | ".join(row)
                         + f" | {cell['wall_seconds']} | `{cell['run_dir']}` |")
        notes = [cell for cell in cells if cell["verdict"] in ("ERROR", "UNSUPPORTED") or not cell["expectation_met"]]
        if notes:
            lines += [""] + [f"- tokens {cell['tokens']}: {cell['verdict']}: {cell['message']}" for cell in notes]
    if report["provenance"]:
        lines += ["", "## Provenance (first cell of each runner)", "", "```json",
                  json.dumps(report["provenance"], indent=2, sort_keys=True, default=str), "```"]
    return "\n".join(lines) + "\n"


def console(report: dict, sweep_dir: Path, out: Console | None = None) -> None:
    out = out or Console(width=None if Console().is_terminal else 160)
    for pair in report["pairs"]:
        table = Table(title=f"{report['case']} on {report['device']}: {pair}")
        for column in ("tokens", "verdict", *report["tensors"]):
            table.add_column(column, justify="right" if column != "verdict" else "left")
        for cell in (c for c in report["cells"] if c["pair"] == pair):
            table.add_row(str(cell["tokens"]), cell["verdict"],
                          *[_matrix_cell(cell["tensors"].get(name)) for name in report["tensors"]],
                          style="green" if cell["verdict"] == "BITWISE_PASS" else "red")
        out.print(table)
    out.print(f"sweep report: {sweep_dir / 'report.md'}  (exit code {report['exit_code']})")



def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
