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

Standard library only (the levels are imported lazily: PaddleFormers takes seconds to import), so the selection is
tested with named test doubles.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.case.ops import OPS
from harness.run.protocol import Unsupported

LEVELS = ("paddlefleet", "paddleformers", "recipe")
VARIANTS = ("fp32_islands",)  # pinned only
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


def import_level(level: str):
    return importlib.import_module(MODULES[level])


def why_not(level: str, request: dict, load: Callable = import_level) -> str | None:
    """Why `level` cannot run `request` here (None: it can)."""
    try:
        module = load(level)
    except Exception as error:  # noqa: BLE001 - a level whose own module does not import is unavailable
        return f"harness module {MODULES[level]} does not import: {type(error).__name__}: {error}"
    op = OPS[request["op"]]
    if op not in module.IMPLEMENTATIONS:
        return f"no {LABELS[level]} implementation of op {op.name!r} is written ({MODULES[level]} IMPLEMENTATIONS)"
    return module.unavailable(request)


def choose(request: dict, load: Callable = import_level) -> Choice:
    """The level that runs `request`; raises Unsupported when the pinned level, or every level, is unavailable."""
    requested = request["config"].get("paddle_impl", AUTO)
    if requested != AUTO:
        if requested not in LEVELS + VARIANTS:
            raise Unsupported(f"config.paddle_impl = {requested!r} is not one of {AUTO}, "
                              f"{', '.join(LEVELS + VARIANTS)}")
        reason = why_not(requested, request, load)
        if reason:
            raise Unsupported(f"config.paddle_impl = {requested!r} pins {LABELS[requested]}, which is unavailable "
                              f"here: {reason}")
        return Choice(requested, load(requested).IMPLEMENTATIONS[OPS[request["op"]]], requested)
    reasons = {}
    for level in LEVELS:
        reason = why_not(level, request, load)
        if reason is None:
            return Choice(level, load(level).IMPLEMENTATIONS[OPS[request["op"]]], AUTO, reasons)
        reasons[level] = reason
    raise Unsupported("no Paddle implementation level is available here: "
                      + "; ".join(f"{LABELS[lv]}: {why}" for lv, why in reasons.items()))


def survey(request: dict, load: Callable = import_level) -> dict:
    """Every level's availability for `request` and the one that would run (the doctor's answer for one op)."""
    levels = {level: why_not(level, request, load) for level in LEVELS + VARIANTS}
    requested = request["config"].get("paddle_impl", AUTO)
    candidates = LEVELS if requested == AUTO else (requested,)
    chosen = next((lv for lv in candidates if lv in levels and levels[lv] is None), None)
    return {"would_run": chosen, "label": LABELS.get(chosen, "UNSUPPORTED"),
            "levels": {lv: "available" if why is None else why for lv, why in levels.items()}}
