"""One run's reports, all from one ``CaseResult``: report.json (machine); report.md and report.html (people),
both rendered from the same blocks so they say the same thing; pictures of differing tensors; a rich
console summary.

The people's report is ``SECTIONS`` in order; each section is ``f(data, figures) -> list of blocks``, where
`data` is ``CaseResult.to_dict()`` (what report.json holds) and `figures` maps a tensor to its pictures.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from harness.compare import model_outputs
from harness.compare.result import CaseResult
from harness.report import blocks as doc
from harness.report import (
    check_sections,
    model_section,
    pictures,
    provenance_section,
    refeed_section,
    summary_section,
    tensor_sections,
    train_pictures,
    train_section,
)

VERDICT_STYLE = {"BITWISE_PASS": "bold green", "DIFF": "bold red", "UNSUPPORTED": "bold yellow", "ERROR": "bold red",
                 "WITHIN_TOLERANCE": "bold green", "NONDETERMINISTIC": "bold magenta"}
SECTIONS = (summary_section.blocks, model_section.blocks, train_section.blocks, tensor_sections.runners,
            tensor_sections.tensors,
            refeed_section.blocks,
            check_sections.versus_oracle, check_sections.tolerance, check_sections.determinism,
            provenance_section.provenance, provenance_section.stderr_tails)


MODEL_PICTURES = 6  # a model case: pictures of its first differing tensors only (hundreds can differ)


def write(result: CaseResult, run_dir: Path) -> None:
    tensors = result.tensors
    if result.model or result.train:
        tensors = [t for t in tensors if t.mismatch_map is not None][:MODEL_PICTURES]
    figures = pictures.render(tensors, run_dir / "pictures")
    figures.update(train_pictures.render(result.train, run_dir / "pictures"))
    data = result.to_dict()
    (run_dir / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    document = blocks(data, figures)
    (run_dir / "report.md").write_text(doc.markdown(document))
    (run_dir / "report.html").write_text(doc.html(document, _title(data), base=run_dir))


def blocks(data: dict, figures: dict[str, dict[str, str]] | None = None) -> list[tuple]:
    """The whole people's report of one run, built once."""
    return [block for section in SECTIONS for block in section(data, figures or {})]


def markdown(result: CaseResult, figures: dict[str, dict[str, str]] | None = None) -> str:
    return doc.markdown(blocks(result.to_dict(), figures))


def html(result: CaseResult, run_dir: Path | None = None, figures: dict[str, dict[str, str]] | None = None) -> str:
    data = result.to_dict()
    return doc.html(blocks(data, figures), _title(data), base=run_dir)


def _title(data: dict) -> str:
    return f"{data['case_name']}: {data['verdict']}"


def console(result: CaseResult, run_dir: Path, out: Console | None = None) -> None:
    out = out or Console(width=None if Console().is_terminal else 160)
    pair = " vs ".join(result.case["runners"]) if result.case else ""
    table = Table(title=f"{result.case_name} on {result.device}" + (f": {pair}" if pair else ""))
    for column in ("tensor", "status", "mismatches", "share", "max ULP", "p99 ULP", "sign flips",
                   "max abs err", "ULPs at scale"):
        table.add_column(column, justify="left" if column in ("tensor", "status") else "right")
    rows = [t.to_dict() for t in result.tensors] if not result.train else []  # a training run: per step, below
    for t in model_outputs.group_rows(rows) if result.model else rows:  # a model: one row per expert family
        table.add_row(t["name"], t["status"], str(t["mismatches"]), f"{t['mismatch_share']:.4%}", str(t["max_ulp"]),
                      str(t["p99_ulp"]), str(t["sign_flips"]), f"{t['max_abs_error']:.3g}",
                      f"{t['max_error_in_scale_ulps']:.3g}", style="green" if t["status"] == "EQUAL" else "red")
    if rows:
        out.print(table)
    for side in result.sides:
        implementation = side.meta.get("implementation", "")
        out.print(escape(f"side {side.label}: {side.runner} [{side.status}] {implementation} "
                         f"({side.wall_seconds:.1f} s){': ' + side.reason if side.reason else ''}"))
    for line in check_sections.console_lines(result.to_dict()):
        out.print(line, highlight=False)
    out.print(f"[{VERDICT_STYLE[result.verdict]}]{result.verdict}[/] {escape(result.message)}", highlight=False)
    if result.first_divergence:
        out.print(f"first divergence: {result.first_divergence}")
    for line in model_section.items(result.to_dict()) + train_section.headline(result.to_dict()):
        _print_item(out, "-", line)
    if result.train:
        for row in train_section.step_rows(result.train):
            _print_item(out, "step", " | ".join(str(cell) for cell in row))
        for line in train_section.refeed_lines(result.train.get("refeed") or {}):
            _print_item(out, "re-feed,", line)
    if result.refeed.get("kind") == "model":
        for line in refeed_section.model_items(result.refeed):
            _print_item(out, "re-feed:", line)
    elif result.refeed.get("stages"):
        out.print(f"re-feed: first tensor made locally: {result.refeed['first_local_divergence'] or 'none'}")
        for name, how in result.refeed["tensors"].items():
            out.print(f"  {name}: {how}")
    if result.expectation.get("stated") and result.expectation["verdict"] != "BITWISE_PASS":
        met = "met" if result.expectation["met"] else "NOT met"
        out.print(f"expected {result.expectation['verdict']}: {met}")
    out.print(f"report: {run_dir / 'report.md'}  (exit code {result.exit_code})")


def _print_item(out: Console, lead: str, line: str) -> None:
    """`lead line`, its wrapped lines indented under `line`: a wrap never puts a word of it at the start of a line,
    where "BITWISE_PASS (128 not compared)" of a model's counts reads as the run's verdict."""
    text = Text(line.replace("**", "").replace("`", ""))
    for i, part in enumerate(text.wrap(out, max(out.width - len(lead) - 1, 20))):
        part.rstrip()
        out.print(Text.assemble(lead if i == 0 else " " * len(lead), " ", part), soft_wrap=True)
