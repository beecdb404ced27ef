"""Where a run's files go: a new folder per run under reports/, never reused, never overwritten."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from harness import paths, resources

REPORTS_DIR = Path(__file__).resolve().parents[2] / "reports"


def new_run_dir(root: Path, label: str = "", prefix: str = "") -> tuple[str, Path]:
    """A fresh folder per run, ``<prefix><timestamp>[-<label>]-<suffix>``; existing runs are never touched."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in label).replace("..", "__")[:60]
    with resources.boundary("reports folder", root):
        root.mkdir(parents=True, exist_ok=True)
        while True:
            run_id = "-".join(filter(None, (f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}", safe,
                                            secrets.token_hex(3))))
            try:
                (paths.child(root, run_id, "run id")).mkdir()
                return run_id, root / run_id
            except FileExistsError:
                if not root.is_dir():
                    raise
                continue


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
