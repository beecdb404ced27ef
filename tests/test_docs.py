"""The docs say what the code does: every relative link resolves (file and heading), and every `python -m harness`
command they quote is accepted by the real parser, so a renamed option or command fails here."""

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from harness.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs/examples").glob("*/README.md")), ROOT / "docs/examples/speed.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"python -m (harness[\w.]*)((?: (?:\\\n\s*)?[^\s`#;&|]+(?:\|[^\s`#;&]+)*)*)")
PLACEHOLDER = re.compile(r"[\[\]<>|]|\.\.\.|^[A-Z][A-Z_0-9=,./:-]*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: of its text as rendered (code spans keep their underscores)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+:", target):
            yield target


def commands(page: Path):
    """(module, arguments) of each `python -m harness...` the page quotes, in code blocks and inline code."""
    for match in COMMAND.finditer(page.read_text()):
        yield match.group(1), shlex.split(match.group(2).replace("\\\n", " "))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_command_parses(page):
    problems = [problem for module, args in commands(page) if (problem := check(module, args))]
    assert not problems, problems


def check(module: str, args: list[str]) -> str | None:
    """None when the command is accepted; else what is wrong. Usage lines with placeholders (`CASE`, `[--x]`, `A|B`)
    are checked option by option; concrete commands are parsed whole."""
    if module.endswith(".") or re.search(r"\.[A-Z]$", module):  # harness.runners.<name>, harness.runners.R
        return None
    if module != "harness":
        known = module_options(module)
        if known is None:
            return f"python -m {module}: no such module"
        unknown = [o for o in options_in(args) if o not in known]
        return f"python -m {module}: unknown options {unknown}" if unknown else None
    parser = build_parser()
    if len(args) > 1 and not any(PLACEHOLDER.search(arg) for arg in args):  # one word names a command (prose)
        try:
            parser.parse_args(args)
        except SystemExit:
            return f"python -m harness {' '.join(args)}: refused by the parser"
        return None
    command = next((a for a in args if not a.startswith("-")), None)
    options = subparser_options(parser, command)
    if options is None:
        return f"python -m harness {command}: no such command"
    unknown = [o for o in options_in(args) if o not in options]
    return f"python -m harness {' '.join(args)}: unknown options {unknown}" if unknown else None


def options_in(args: list[str]) -> list[str]:
    return [option for arg in args for option in re.findall(r"--[\w-]+", arg)]


def subparser_options(parser, command: str | None) -> set[str] | None:
    top = {o for action in parser._actions for o in action.option_strings}
    commands = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    if command not in commands:
        return None
    found = top | {o for action in commands[command]._actions for o in action.option_strings}
    for action in commands[command]._actions:  # `baseline update`: one level deeper
        if isinstance(action.choices, dict):
            for sub in action.choices.values():
                found |= {o for a in sub._actions for o in a.option_strings}
    return found


@cache
def module_options(module: str) -> frozenset[str] | None:
    """The options `python -m MODULE --help` lists (a runner or a command module), or None if it does not run."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    if done.returncode != 0:
        return None
    return frozenset(re.findall(r"(--[\w-]+)", done.stdout))


def test_the_checks_see_a_renamed_option_a_missing_command_and_a_broken_link(tmp_path):
    """Negative controls: each kind of drift is caught."""
    assert check("harness", ["compare", "kimi_shared_fc1", "--no-such-option"])
    assert check("harness", ["compare", "CASE", "[--renamed-option]"])
    assert check("harness", ["no-such-command"])
    assert check("harness", ["compare", "kimi_shared_fc1", "--tokens", "16"]) is None
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](#nope)\n")
    assert [t for t in links(page)] == ["missing.md", "#title", "#nope"]
    assert anchors(page) == {"title"}
