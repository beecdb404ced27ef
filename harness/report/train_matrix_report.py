"""The knob matrix of a training case (matrix.md, matrix.html, the console table): one row per setting, the tensors
that differ per quantity over all steps and, against the case as written, how many fewer or more. Reads only the cells
matrix.json holds (harness.commands.train_matrix)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness.case.ops import step_quantities
from harness.optimizers import OPTIMIZERS
from harness.report import blocks as doc
from harness.report.blocks import h, p, table
from harness.report.case_report import VERDICT_STYLE
from harness.report.train_section import label


def write(name: str, cells: list[dict], matrix_dir: Path) -> None:
    document = blocks(name, cells)
    (matrix_dir / "matrix.md").write_text(doc.markdown(document))
    (matrix_dir / "matrix.html").write_text(doc.html(document, f"Knob matrix: {name}", base=matrix_dir))


def setting(cell: dict) -> str:
    return ", ".join(f"{k} = {v}" for k, v in cell["setting"].items()) or "the case as written"


def quantities(cells: list[dict]) -> list[str]:
    """The quantities any cell counts, in a step's order (every cell trains with the case's optimizer)."""
    return sorted({q for c in cells for q in c["differing"]}, key=_position)


def _position(quantity: str) -> int:
    return next(order.index(quantity) for order in map(step_quantities, OPTIMIZERS.values()) if quantity in order)


def change(cell: dict, baseline: dict, quantity: str) -> str:
    """"12 (-30)": differing now, and the change against the case as written."""
    if quantity not in cell["differing"]:
        return ""
    now, before = cell["differing"][quantity], baseline["differing"].get(quantity, 0)
    delta = now - before
    return f"{now}" + (f" ({delta:+d})" if delta and cell is not baseline else "")


def first(cell: dict) -> str:
    f = cell["first_divergence"]
    return f"step {f['step']}, {label(f['quantity'])}" if f else "none"


def blocks(name: str, cells: list[dict]) -> list[tuple]:
    baseline = cells[0]
    columns = quantities(cells)
    rows = [[setting(c), f"**{c['verdict']}**", first(c), *(change(c, baseline, q) for q in columns),
             f"`{c['report']}`"] for c in cells]
    return [h(1, f"Knob matrix: {name}"),
            p(f"{baseline['sides']}. Each row is the case with one choice set through every stack's own API (a param "
              "group, a flag, a config field); each cell the tensors (scalars: steps) whose bits differ over all "
              "steps, and in brackets the change against the case as written. A knob that removes a difference "
              "names the choice behind it; what no knob removes is a formula difference."),
            table(["setting", "verdict", "first divergence in time", *(label(q) for q in columns),
                   "report"], rows, "lll" + "r" * len(columns) + "l")]


def markdown(name: str, cells: list[dict]) -> str:
    return doc.markdown(blocks(name, cells))


def console(name: str, cells: list[dict], matrix_dir: Path, out: Console | None = None) -> None:
    matrix = Table(title=f"knob matrix: {name}")
    columns = quantities(cells)
    for column in ("setting", "verdict", "first divergence", *(label(q) for q in columns)):
        matrix.add_column(column)
    for c in cells:
        matrix.add_row(setting(c), f"[{VERDICT_STYLE[c['verdict']]}]{c['verdict']}[/]", first(c),
                       *(change(c, cells[0], q) for q in columns))
    out = out or Console(width=None if Console().is_terminal else 200)
    out.print(matrix)
    out.print(f"matrix: {matrix_dir / 'matrix.md'}")
