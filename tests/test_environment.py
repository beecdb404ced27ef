"""One environment, the one that was tested: `make` installs every package at its pin in constraints.txt.

A fresh clone's `make test` then tests what CI tested, whatever PyPI has published since. When a pin has to move,
`make lock` rewrites constraints.txt from requirements-*.txt (see its header).
"""

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = sorted(ROOT.glob("requirements-*.txt"))


def pins(text: str) -> dict[str, str]:
    """name -> pinned version, for the lines of a constraints file whose environment marker holds here."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, _, marker = line.partition(";")
        name, sep, version = spec.strip().partition("==")
        if not sep:
            raise ValueError(f"constraints.txt: {line!r} is not pinned with ==")
        if not marker.strip() or Marker(marker.strip()).evaluate():
            found[canonicalize_name(name)] = version.strip()
    return found


def requirement_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(re.split(r"[<>=!~ ;\[]", line, maxsplit=1)[0]))
    return names


def test_every_requirement_is_pinned_in_the_lock():
    locked = pins((ROOT / "constraints.txt").read_text())
    missing = {path.name: sorted(requirement_names(path) - set(locked)) for path in REQUIREMENTS}
    assert not any(missing.values()), f"not in constraints.txt (run `make lock`): {missing}"


def test_the_project_environment_is_the_locked_one():
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"{sys.prefix} is not this clone's .venv (built by make): its versions are the user's choice")
    locked = pins((ROOT / "constraints.txt").read_text())
    wrong = {}
    for name, pinned in locked.items():
        try:
            installed = Version(metadata.version(name)).public
        except metadata.PackageNotFoundError:
            installed = None
        if installed != Version(pinned).public:
            wrong[name] = {"pinned": pinned, "installed": installed}
    assert not wrong, f"the .venv differs from constraints.txt (rebuild it: rm -rf .venv && make test): {wrong}"


def test_pins_reads_markers_and_refuses_a_range():
    assert pins('a==1.0\nb==2.0 ; python_version < "3"\n# note\n') == {"a": "1.0"}
    with pytest.raises(ValueError, match="not pinned"):
        pins("c>=1\n")
