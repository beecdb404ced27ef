"""The accuracy-gate matrix's people's reports (matrix.md, matrix.html) and console table: one row per
setting of ``use_accuracy_compatible``, built once as blocks. Reads only the cells that matrix.json holds."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness.report import blocks as doc
from harness.report.blocks import h, table
from harness.report.case_report import VERDICT_STYLE


def write(name: str, cells: list[dict], matrix_dir: Path) -> None:
    document = blocks(name, cells)
    (matrix_dir / "matrix.md").write_text(doc.markdown(document))
    (matrix_dir / "matrix.html").write_text(doc.html(document, f"Accuracy-gate matrix: {name}", base=matrix_dir))


def markdown(name: str, cells: list[dict]) -> str:
    return doc.markdown(blocks(name, cells))


def blocks(name: str, cells: list[dict]) -> list[tuple]:
    rows = [[_setting(c), c["sides"], f"**{c['verdict']}**", c["first_divergence"] or "", _why(c),
             " / ".join(c["implementations"]), f"`{c['report']}`"] for c in cells]
    return [h(1, f"Accuracy-gate matrix: {name}"),
            table(["use_accuracy_compatible", "sides", "verdict", "first divergence", "why / differing tensors",
                   "implementations", "report"], rows)]


def console(name: str, cells: list[dict], matrix_dir: Path, out: Console | None = None) -> None:
    matrix = Table(title=f"accuracy-gate matrix: {name}")
    for column in ("gate", "sides", "verdict", "first divergence", "why"):
        matrix.add_column(column)
    for c in cells:
        matrix.add_row(_setting(c), c["sides"], f"[{VERDICT_STYLE[c['verdict']]}]{c['verdict']}[/]",
                       c["first_divergence"] or "", _why(c)[:160])
    out = out or Console(width=None if Console().is_terminal else 160)
    out.print(matrix)
    out.print(f"matrix: {matrix_dir / 'matrix.md'}")


def _setting(cell: dict) -> str:
    return "on" if cell["use_accuracy_compatible"] else "off"


def _why(cell: dict) -> str:
    return ", ".join(cell["differing"]) if cell["verdict"] == "DIFF" else cell["message"]
