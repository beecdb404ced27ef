"""The one document model every report is built in, so its report.md and report.html say the same thing.

A report is a list of blocks, built once and rendered twice: ``markdown(blocks)`` and ``html(blocks, title)``.
Blocks are plain tuples tagged by kind, so a section computed in an earlier stage (``harness.baselines.trend``)
can return blocks without importing this package; the constructors below only spell them:

    ("h", level, text)                  heading
    ("p", text)                         paragraph
    ("ul", [text, ...])                 bulleted list
    ("table", header, rows, align)      align: one "l" or "r" per column ("" = all left); cells may hold "\\n"
    ("pre", text, language)             preformatted, verbatim (JSON, a stderr tail); language may be ""
    ("figure", src, alt)                a picture; src is relative to the report's folder, HTML embeds it
    ("details", summary, [block, ...])  collapsible (GitHub renders <details> in Markdown too)

Text (everything but ``pre``) may use three inline marks, the same in both outputs: `code`, **bold** and
[text](link). Nothing else in a text is markup.
"""

from __future__ import annotations

from pathlib import Path

from harness.report import to_html, to_markdown

KINDS = ("h", "p", "ul", "table", "pre", "figure", "details")


def h(level: int, text: str) -> tuple:
    return ("h", level, text)


def p(text: str) -> tuple:
    return ("p", text)


def ul(items: list[str]) -> tuple:
    return ("ul", list(items))


def table(header: list[str], rows: list[list], align: str = "") -> tuple:
    return ("table", list(header), [list(row) for row in rows], align)


def pre(text: str, language: str = "") -> tuple:
    return ("pre", text, language)


def figure(src: str, alt: str) -> tuple:
    return ("figure", src, alt)


def details(summary: str, inner: list[tuple]) -> tuple:
    return ("details", summary, list(inner))


def markdown(blocks: list[tuple]) -> str:
    return to_markdown.render(blocks)


def html(blocks: list[tuple], title: str, base: Path | None = None) -> str:
    """A self-contained page; with `base` (the report's folder) every figure is embedded as base64."""
    return to_html.render(blocks, title, base)
