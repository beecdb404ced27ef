"""Which implementation the Paddle side runs: PaddleFleet, then PaddleFormers' module, then the recipe.

Three levels, highest first, each a module with an ``IMPLEMENTATIONS`` table keyed by the op record and
``unavailable(request) -> str | None`` (why it cannot run this request here):
1. ``paddlefleet``  - ``harness.runners.paddle.fleet``: PaddleFleet's modules or functions with the case's
   ``use_accuracy_compatible`` (GPU, where ``paddlefleet`` imports; checked against a stand-in package only);
2. ``paddleformers`` - ``harness.runners.paddle.formers``: PaddleFormers' module (DeepseekV3 and its shared modules);
3. ``recipe``       - ``harness.runners.paddle.recipe``: plain Paddle ops computing what the PaddleFleet code it cites
   computes, the reference recipe, not PaddleFleet.
``config.paddle_impl`` (a knob every op reads, default ``auto``) pins a level; ``auto`` takes the highest one available.
A pin may also name a variant ``auto`` never takes: ``fp32_islands`` (``harness.runners.paddle.islands``, the recipe
with the seed PR's FP32-island SwiGLU).
A pinned level that is unavailable, or ``auto`` with none, is UNSUPPORTED naming each level and why.

Unavailable means one of two things: the level's package (``PACKAGES``) is not installed, or the level says it cannot
run this request on this device and dtype (GPU only, a kernel Paddle says is not registered). A level whose package
is installed but does not import (its own ``_import_problem``), or whose harness module does not import, is broken:
``BrokenLevel``, an ERROR naming it, never a quiet step down to the level below.

Standard library only (the levels are imported lazily: PaddleFormers takes seconds to import), so the selection is
tested with named test doubles.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.case.ops import OPS
from harness.run.protocol import Unsupported

LEVELS = ("paddlefleet", "paddleformers", "recipe")
VARIANTS = ("fp32_islands",)  # pinned only
PACKAGES = {"paddlefleet": "paddlefleet", "paddleformers": "paddleformers"}  # the third-party package of a level
BROKEN = "BROKEN: "
AUTO = "auto"
MODULES = {"paddlefleet": "harness.runners.paddle.fleet", "paddleformers": "harness.runners.paddle.formers",
           "recipe": "harness.runners.paddle.recipe", "fp32_islands": "harness.runners.paddle.islands"}
LABELS = {"paddlefleet": "PaddleFleet", "paddleformers": "PaddleFormers' module (not PaddleFleet)",
          "recipe": "reference recipe, not PaddleFleet",
          "fp32_islands": "recipe variant with the seed PR's FP32 islands, not PaddleFleet"}


@dataclass
class Choice:
    level: str
    implementation: Callable
    requested: str  # "auto" or the pinned level
    reasons: dict[str, str] = field(default_factory=dict)  # levels passed over (or all levels, surveyed) -> why

    def meta(self) -> dict:
        return {"paddle_level": self.level, "paddle_level_label": LABELS[self.level], "paddle_impl": self.requested,
                "paddle_levels_unavailable": dict(self.reasons)}


class BrokenLevel(Exception):
    """A level that is installed but does not import: the cell is an ERROR naming it."""


def import_level(level: str):
    return importlib.import_module(MODULES[level])


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def why_not(level: str, request: dict, load: Callable = import_level,
            is_installed: Callable[[str], bool] = installed) -> str | None:
    """Why `level` cannot run `request` here (None: it can); raises BrokenLevel for an installed level that does not
    import."""
    package = PACKAGES.get(level)
    if package and not is_installed(package):
        return f"{package} is not installed for {sys.executable}"
    try:
        module = load(level)
        problem = module._import_problem() if package else None  # the level's own import of its package
    except Exception as error:  # noqa: BLE001 - the harness's level module itself does not import
        raise BrokenLevel(f"{LABELS[level]}: harness module {MODULES[level]} does not import: "
                          f"{type(error).__name__}: {error}") from error
    if problem:
        raise BrokenLevel(f"{LABELS[level]}: {package} is installed but does not import: {problem}")
    op = OPS[request["op"]]
    if op not in module.IMPLEMENTATIONS:
        return f"no {LABELS[level]} implementation of op {op.name!r} is written ({MODULES[level]} IMPLEMENTATIONS)"
    return module.unavailable(request)


def choose(request: dict, load: Callable = import_level, is_installed: Callable[[str], bool] = installed) -> Choice:
    """The level that runs `request`; raises Unsupported when the pinned level, or every level, is unavailable, and
    BrokenLevel when a level it reaches is broken."""
    requested = request["config"].get("paddle_impl", AUTO)
    if requested != AUTO:
        if requested not in LEVELS + VARIANTS:
            raise Unsupported(f"config.paddle_impl = {requested!r} is not one of {AUTO}, "
                              f"{', '.join(LEVELS + VARIANTS)}")
        reason = why_not(requested, request, load, is_installed)
        if reason:
            raise Unsupported(f"config.paddle_impl = {requested!r} pins {LABELS[requested]}, which is unavailable "
                              f"here: {reason}")
        return Choice(requested, load(requested).IMPLEMENTATIONS[OPS[request["op"]]], requested)
    reasons = {}
    for level in LEVELS:
        reason = why_not(level, request, load, is_installed)
        if reason is None:
            return Choice(level, load(level).IMPLEMENTATIONS[OPS[request["op"]]], AUTO, reasons)
        reasons[level] = reason
    raise Unsupported("no Paddle implementation level is available here: "
                      + "; ".join(f"{LABELS[lv]}: {why}" for lv, why in reasons.items()))


def survey(request: dict, load: Callable = import_level, is_installed: Callable[[str], bool] = installed) -> dict:
    """Every level's availability for `request` and the one that would run (the doctor's answer for one op); a
    broken level the choice reaches is named under "broken" (the request would be an ERROR)."""
    levels = {}
    for level in LEVELS + VARIANTS:
        try:
            levels[level] = why_not(level, request, load, is_installed)
        except BrokenLevel as error:
            levels[level] = f"{BROKEN}{error}"
    requested = request["config"].get("paddle_impl", AUTO)
    candidates = [lv for lv in (LEVELS if requested == AUTO else (requested,)) if lv in levels]
    reached = next((lv for lv in candidates if levels[lv] is None or levels[lv].startswith(BROKEN)), None)
    answer = {"would_run": None, "label": "UNSUPPORTED",
              "levels": {lv: "available" if why is None else why for lv, why in levels.items()}}
    if reached and levels[reached] is None:
        answer.update(would_run=reached, label=LABELS[reached])
    elif reached:
        answer.update(label=f"ERROR: {LABELS[reached]} is broken", broken=reached)
    return answer
