"""Blocks (``harness.report.blocks``) to one self-contained HTML page: inline style, pictures as base64,
no script and no link to fetch, so report.html opens from an artifact or a mail the same as from disk."""

from __future__ import annotations

import base64
import html as _html
import re
from pathlib import Path

INLINE = re.compile(r"`([^`]*)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")
# A cell that says only one of these gets it as its class: the tables read at a glance, as in a terminal.
STATUS_CLASSES = {"EQUAL": "ok", "BITWISE_PASS": "ok", "WITHIN_TOLERANCE": "ok", "yes": "ok",
                  "DIFF": "bad", "ERROR": "bad", "NONDETERMINISTIC": "bad", "**no**": "bad", "**DIFF**": "bad",
                  "**ERROR**": "bad", "UNSUPPORTED": "skip", "**UNSUPPORTED**": "skip", "**BITWISE_PASS**": "ok"}
STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:110em;color:#222}
table{border-collapse:collapse;margin:.5em 0;font-size:13px}td,th{border:1px solid #bbb;padding:.2em .5em;
text-align:left;vertical-align:top}th{background:#eee}td.r,th.r{text-align:right}td.ok{background:#e8f5e9}
td.bad{background:#ffebee}td.skip{background:#fff8e1}code{background:#f3f3f3;padding:0 .2em}
pre{background:#f6f6f6;padding:.5em;overflow:auto;font-size:12px}img{max-width:100%;margin:4px 0}
details{margin:.5em 0}summary{cursor:pointer}figure{margin:.5em 0}"""


def render(blocks: list[tuple], title: str, base: Path | None = None) -> str:
    body = "\n".join(_block(block, base) for block in blocks)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_html.escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")


def inline(text) -> str:
    """Escaped text with the three inline marks made into tags."""
    text = str(text)
    parts, last = [], 0
    for match in INLINE.finditer(text):
        parts.append(_html.escape(text[last:match.start()]))
        code, bold, label, href = match.groups()
        if code is not None:
            parts.append(f"<code>{_html.escape(code)}</code>")
        elif bold is not None:
            parts.append(f"<b>{_html.escape(bold)}</b>")
        else:
            parts.append(f'<a href="{_html.escape(href)}">{_html.escape(label)}</a>')
        last = match.end()
    parts.append(_html.escape(text[last:]))
    return "".join(parts)


def _block(block: tuple, base: Path | None) -> str:
    kind = block[0]
    if kind == "h":
        return f"<h{block[1]}>{inline(block[2])}</h{block[1]}>"
    if kind == "p":
        return f"<p>{inline(block[1])}</p>"
    if kind == "ul":
        return "<ul>" + "".join(f"<li>{inline(item)}</li>" for item in block[1]) + "</ul>"
    if kind == "table":
        header, rows = block[1], block[2]
        align = block[3] if len(block) > 3 and block[3] else "l" * len(header)
        head = "".join(_cell("th", value, a) for value, a in zip(header, align, strict=True))
        body = "".join("<tr>" + "".join(_cell("td", value, a) for value, a in zip(row, align, strict=True))
                       + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if kind == "pre":
        return f"<pre>{_html.escape(block[1].rstrip())}</pre>"
    if kind == "figure":
        return f"<figure>{_image(block[1], block[2], base)}</figure>"
    if kind == "details":
        inner = "\n".join(_block(inner, base) for inner in block[2])
        return f"<details><summary>{inline(block[1])}</summary>\n{inner}\n</details>"
    raise ValueError(f"unknown block kind {kind!r} (known: h, p, ul, table, pre, figure, details)")


def _cell(tag: str, value, align: str) -> str:
    text = str(value)
    classes = " ".join(filter(None, ["r" if align == "r" else "", STATUS_CLASSES.get(text, "")]))
    attribute = f' class="{classes}"' if classes else ""
    return f"<{tag}{attribute}>" + "<br>".join(inline(line) for line in text.split("\n")) + f"</{tag}>"


def _image(src: str, alt: str, base: Path | None) -> str:
    alt_text = _html.escape(str(alt).replace("\n", " "))
    path = base / src if base is not None else None
    if path is None or not path.is_file():  # no folder to read from: link the file as report.md does
        return f'<img alt="{alt_text}" src="{_html.escape(src)}">'
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{alt_text}" src="data:image/png;base64,{encoded}">'
