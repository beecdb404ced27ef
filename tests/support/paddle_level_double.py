"""Test double, named as such: a stand-in Paddle implementation level, to test ``compare --versus-impl`` (the
harness's own plumbing: each side gets its own ``config.paddle_impl``, the same inputs, one comparison); it never
gives a reported verdict of a real comparison.

``interpreter(folder)`` writes an executable the harness starts as the Paddle runner's interpreter
(``--python paddle=PATH``). It runs the real Paddle runner with one change: the ``fp32_islands`` level is this module,
whose rms_norm is the recipe's with bit 0 of ``out``'s first element flipped. So a recipe side and an
``fp32_islands`` side differ in exactly ``out``.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from harness.case import ops

DOUBLE_LEVEL = "fp32_islands"


def interpreter(folder: Path) -> str:
    path = Path(folder) / "paddle_level_double_python"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -m tests.support.paddle_level_double "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def rms_norm(request, tensors, gate, phases, guard):
    from harness.runners.paddle import recipe

    outputs, _ = recipe.rms_norm(request, tensors, gate, phases, guard)
    out = outputs["out"]
    out.reshape(-1).view(f"u{out.itemsize}")[0] ^= 1
    return outputs, "test double level: the recipe's rms_norm with bit 0 of out[0] flipped"


def source(request) -> str:
    return "test double (tests/support/paddle_level_double.py)"


def unavailable(request):
    return None


IMPLEMENTATIONS = {ops.RMS_NORM: rms_norm}


if __name__ == "__main__":
    from harness.runners.paddle import levels, runner

    levels.MODULES[DOUBLE_LEVEL] = "tests.support.paddle_level_double"
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a not in ("-m", "harness.runners.paddle")]
    runner.main()
