"""Levels as records: op, model, train (``harness.levels.base`` declares what each one implements).

The op record names its level (``Op.level``); ``level_of`` is the one place that maps a case to its level.
"""

from __future__ import annotations

from harness.case.registry import Case
from harness.levels import model, op, train
from harness.levels.base import AXES, Level, Run, Versus

LEVELS: dict[str, Level] = {level.name: level for level in (op.LEVEL, model.LEVEL, train.LEVEL)}

__all__ = ["AXES", "LEVELS", "Level", "Run", "Versus", "level_of"]


def level_of(case: Case) -> Level:
    return LEVELS[case.op_spec.level]
