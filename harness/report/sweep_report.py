"""A sweep's people's reports (report.md, report.html) and console tables: per runner pair, a matrix of token
counts by tensors, built once as blocks. Reads only the sweep's report dict (what its report.json holds)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness.report import blocks as doc
from harness.report.blocks import h, pre, table, ul


def write(report: dict, sweep_dir: Path) -> None:
    document = blocks(report)
    (sweep_dir / "report.md").write_text(doc.markdown(document))
    (sweep_dir / "report.html").write_text(doc.html(document, f"Sweep {report['sweep_id']}", base=sweep_dir))


def markdown(report: dict) -> str:
    return doc.markdown(blocks(report))


def blocks(report: dict) -> list[tuple]:
    counts = ", ".join(f"{verdict} {n}" for verdict, n in sorted(report["verdicts"].items()))
    out = [h(1, f"Sweep: {report['case']} on {report['device']}"),
           ul([f"sweep: `{report['sweep_id']}`, {report['started_at']} to {report['finished_at']}",
               f"command: `{' '.join(report['argv'])}`",
               f"cells: {len(report['cells'])} ({counts}); exit code {report['exit_code']}",
               "a matrix cell: `=` bitwise equal; `N (share, max U ULP)`: N elements differ; `—`: no comparison "
               "(see the notes). Side a against side b; each cell's full report is `<run>/report.md`."])]
    for pair in report["pairs"]:
        cells = [cell for cell in report["cells"] if cell["pair"] == pair]
        rows = [[cell["tokens"], cell["verdict"], *_matrix_row(cell, report["tensors"]), cell["wall_seconds"],
                 f"`{cell['run_dir']}`"] for cell in cells]
        out += [h(2, pair),
                table(["tokens", "verdict", *report["tensors"], "wall s", "run"], rows,
                      "rl" + "r" * len(report["tensors"]) + "rl")]
        notes = [cell for cell in cells if cell["verdict"] in ("ERROR", "UNSUPPORTED") or not cell["expectation_met"]]
        if notes:
            out.append(ul([f"tokens {cell['tokens']}: {cell['verdict']}: {cell['message']}" for cell in notes]))
    if report["provenance"]:
        out += [h(2, "Provenance (first cell of each runner)"),
                pre(json.dumps(report["provenance"], indent=2, sort_keys=True, default=str), "json")]
    return out


def _matrix_row(cell: dict, tensors: list[str]) -> list[str]:
    return [matrix_cell(cell["tensors"].get(name)) for name in tensors]


def matrix_cell(tensor: dict | None) -> str:
    if tensor is None:
        return "—"
    if tensor["status"] == "EQUAL":
        return "="
    if tensor["status"] == "DIFF":
        return f"{tensor['mismatches']} ({tensor['mismatch_share']:.2%}, max {tensor['max_ulp']} ULP)"
    return tensor["status"]


def console(report: dict, sweep_dir: Path, out: Console | None = None) -> None:
    out = out or Console(width=None if Console().is_terminal else 160)
    for pair in report["pairs"]:
        matrix = Table(title=f"{report['case']} on {report['device']}: {pair}")
        for column in ("tokens", "verdict", *report["tensors"]):
            matrix.add_column(column, justify="right" if column != "verdict" else "left")
        for cell in (c for c in report["cells"] if c["pair"] == pair):
            matrix.add_row(str(cell["tokens"]), cell["verdict"],
                           *_matrix_row(cell, report["tensors"]),
                           style="green" if cell["verdict"] == "BITWISE_PASS" else "red")
        out.print(matrix)
    out.print(f"sweep report: {sweep_dir / 'report.md'}  (exit code {report['exit_code']})")
