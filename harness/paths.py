"""Names that become paths: the one place that decides whether a name may name a file or folder.

A case name becomes ``checkpoints/<case>/``, a runner name ``<side>-<runner>/``, a run id ``reports/<run id>/``,
a tensor name a picture file. A name made by a person (a case table in TOML, ``--python RUNNER=...``) is
checked and refused with a clear error when it could leave its folder; a name read from data (a tensor name
in someone's dump) is mapped to a safe, unique file stem. Either way, no path leaves its folder.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

MAX_NAME = 128
_SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
RULE = "letters, digits and _ . + - only, not starting with . or -, no '..', at most 128 characters"


class UnsafeName(ValueError):
    """A name that cannot become a file or folder name; the message says which name, of what, and the rule."""


def check(name: object, kind: str) -> str:
    """`name` if it is safe as one path component; else UnsafeName naming the kind ("case", "runner", ...)."""
    if not isinstance(name, str) or not _SAFE.match(name) or ".." in name or len(name) > MAX_NAME:
        raise UnsafeName(f"{kind} name {name!r} cannot become a file or folder name ({RULE})")
    return name


def child(root: Path, name: str, kind: str) -> Path:
    """``root / name`` for a checked name, and proof that it stays inside `root` (symlinks included)."""
    path = Path(root) / check(name, kind)
    inside(Path(root), path, kind)
    return path


def inside(root: Path, path: Path, kind: str) -> Path:
    """`path` if it resolves inside `root`; else UnsafeName."""
    base, resolved = Path(root).resolve(), Path(path).resolve()
    if resolved != base and base not in resolved.parents:
        raise UnsafeName(f"{kind} path {str(path)!r} resolves to {resolved}, outside {base}")
    return Path(path)


def file_stem(name: str) -> str:
    """A safe file stem for a name read from data: the name itself when safe, else a cleaned form plus a short
    hash of the original (so two names that clean alike never share a file)."""
    try:
        return check(name, "file")
    except UnsafeName:
        cleaned = re.sub(r"[^A-Za-z0-9_.+-]", "_", name).replace("..", "__").lstrip(".-")[:80] or "_"
        return f"{cleaned}-{hashlib.sha256(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"
