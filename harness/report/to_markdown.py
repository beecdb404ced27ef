"""Blocks (``harness.report.blocks``) to Markdown as GitHub renders it: report.md, and the nightly comment."""

from __future__ import annotations

import re

from harness.report import to_html


def render(blocks: list[tuple]) -> str:
    return "\n\n".join(_block(block) for block in blocks) + "\n"


def _block(block: tuple) -> str:
    kind = block[0]
    if kind == "h":
        return f"{'#' * block[1]} {_line(block[2])}"
    if kind == "p":
        return _line(block[1])
    if kind == "ul":
        return "\n".join(f"- {_line(item)}" for item in block[1])
    if kind == "table":
        header, rows = block[1], block[2]
        align = block[3] if len(block) > 3 and block[3] else "l" * len(header)
        lines = [_row(header), "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
        return "\n".join(lines + [_row(row) for row in rows])
    if kind == "pre":
        text, language = block[1].rstrip(), block[2] if len(block) > 2 else ""
        longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
        fence = "`" * max(3, longest + 1)  # a stderr tail may hold ``` itself
        return f"{fence}{language}\n{text}\n{fence}"
    if kind == "figure":
        return f"![{_line(block[2])}]({block[1]})"
    if kind == "details":
        inner = "\n\n".join(_block(inner) for inner in block[2])
        return f"<details><summary>{to_html.inline(block[1])}</summary>\n\n{inner}\n\n</details>"
    raise ValueError(f"unknown block kind {kind!r} (known: h, p, ul, table, pre, figure, details)")


def _row(cells: list) -> str:
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def _line(text) -> str:
    """Markdown ends a paragraph or list item at a newline; HTML folds it into a space, so do the same."""
    return str(text).replace("\n", " ")
