"""Test doubles, named as such: stand-ins for broken runners and interpreters, to test the harness's own
handling of failures. They never produce a reported verdict of a real comparison."""

from __future__ import annotations

import stat
import textwrap
import time


def fake_interpreter(folder, name, body) -> str:
    """An executable script at `folder`/`name` used as a runner's interpreter (``--python RUNNER=PATH``)."""
    path = folder / name
    path.write_text(textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def alive(pid, wait=5.0) -> bool:
    """True if `pid` still runs after `wait` seconds (a zombie awaiting its reaper counts as dead)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True
