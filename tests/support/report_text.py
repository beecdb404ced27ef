"""Reading a report's Markdown and HTML back into text blocks, to check both renderers say the same thing (the
block model of harness.report.blocks: one content, two renderings)."""

from __future__ import annotations

import html
import html.parser
import re
from collections import Counter


class _HtmlTexts(html.parser.HTMLParser):
    """The text of every block element of a page, as (kind, text); pictures as ("img", alt)."""
    KINDS = {"h1": "h", "h2": "h", "h3": "h", "h4": "h", "p": "p", "li": "li", "th": "cell", "td": "cell",
             "pre": "pre", "summary": "summary"}

    def __init__(self):
        super().__init__()
        self.units, self.open, self.images = [], None, []

    def handle_starttag(self, tag, attrs):
        if tag in self.KINDS:
            self.open = [self.KINDS[tag], tag, ""]
        elif tag == "br" and self.open:
            self.open[2] += " "
        elif tag == "img":
            self.images.append(dict(attrs))
            self.units.append(("img", dict(attrs)["alt"]))

    def handle_endtag(self, tag):
        if self.open and tag == self.open[1]:
            self.units.append((self.open[0], _norm(self.open[2])))
            self.open = None

    def handle_data(self, data):
        if self.open:
            self.open[2] += data


def html_texts(page: str) -> tuple[list, list]:
    parser = _HtmlTexts()
    parser.feed(page)
    return parser.units, parser.images


def markdown_texts(text: str) -> list:
    """The text of every block of report.md, read the way GitHub reads it, marks taken off."""
    units, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        fence = re.fullmatch(r"(`{3,})\w*", line)
        if fence:
            end = lines.index(fence.group(1), i + 1)
            units.append(("pre", _norm("\n".join(lines[i + 1:end]))))
            i = end + 1
            continue
        summary = re.fullmatch(r"<details><summary>(.*)</summary>", line)
        image = re.fullmatch(r"!\[(.*)\]\((.*)\)", line)
        if not line.strip() or line == "</details>" or re.fullmatch(r"\|(-+:?\|)+", line):
            pass
        elif summary:
            units.append(("summary", _norm(html.unescape(re.sub(r"<[^>]+>", "", summary.group(1))))))
        elif image:
            units.append(("img", image.group(1)))
        elif line.startswith("|"):
            units += [("cell", _plain(cell.replace("\\|", "|").replace("<br>", " ")))
                      for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        elif re.match(r"#{1,6} ", line):
            units.append(("h", _plain(line.split(" ", 1)[1])))
        elif line.startswith("- "):
            units.append(("li", _plain(line[2:])))
        else:
            units.append(("p", _plain(line)))
        i += 1
    return units


def _plain(text: str) -> str:
    return _norm(re.sub(r"`([^`]*)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\([^)\s]+\)",
                        lambda m: next(g for g in m.groups() if g is not None), text))


def _norm(text: str) -> str:
    return " ".join(text.split())


def assert_same_text(markdown: str, page: str) -> list:
    md, (from_html, images) = markdown_texts(markdown), html_texts(page)
    assert md, "no text read from the Markdown"
    missing, extra = Counter(md) - Counter(from_html), Counter(from_html) - Counter(md)
    assert not missing and not extra, f"only in report.md: {list(missing)}\nonly in report.html: {list(extra)}"
    assert md == from_html  # and in the same order
    assert "<script" not in page and "<link" not in page  # self-contained
    return images
