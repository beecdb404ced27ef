"""A tiny document model so the nightly Markdown and HTML say exactly the same thing.

Blocks: ``("h", level, text)``, ``("p", text)``, ``("ul", [text, ...])``, ``("table", header, rows)``,
``("pre", text)``. Text may use two inline marks, ```code``` and ``**bold**``.
"""

from __future__ import annotations

import html as _html
import re

_INLINE = re.compile(r"`([^`]*)`|\*\*([^*]+)\*\*")
STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:110em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #bbb;padding:.2em .5em;text-align:left}
th{background:#eee}code{background:#f3f3f3;padding:0 .2em}pre{background:#f6f6f6;padding:.5em;overflow:auto}"""


def markdown(blocks: list[tuple]) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append(f"{'#' * block[1]} {block[2]}")
        elif kind == "p":
            out.append(block[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            header, rows = block[1], block[2]
            lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "pre":
            out.append(f"```\n{block[1].rstrip()}\n```")
    return "\n\n".join(out) + "\n"


def html(blocks: list[tuple], title: str) -> str:
    body = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            body.append(f"<h{block[1]}>{_inline(block[2])}</h{block[1]}>")
        elif kind == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(str(c))}</th>" for c in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in row) + "</tr>" for row in block[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "pre":
            body.append(f"<pre>{_html.escape(block[1].rstrip())}</pre>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_html.escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _inline(text: str) -> str:
    parts, last = [], 0
    for match in _INLINE.finditer(text):
        parts.append(_html.escape(text[last:match.start()]))
        code, bold = match.groups()
        parts.append(f"<code>{_html.escape(code)}</code>" if code is not None else f"<b>{_html.escape(bold)}</b>")
        last = match.end()
    parts.append(_html.escape(text[last:]))
    return "".join(parts)
