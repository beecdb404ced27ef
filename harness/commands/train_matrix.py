"""The knob matrix of a training case (``compare CASE --gate-matrix`` on a training case, docs/training.md): the case
as written, then with each choice the stacks make differently set to one value through every stack's own API, then
all of them aligned. Each cell is an ordinary run with its own report; the matrix says per cell how many tensors
differ per quantity over all steps and how many fewer (or more) than the case as written: which knob removes which
difference. A difference no knob removes is a formula difference (Paddle's Adam, Momentum and clip, Megatron's norm).
Exit code: 2 if a cell is ERROR, else 0 (the matrix reports, it does not judge).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harness import pipeline
from harness.case.registry import Registry
from harness.case.train_settings import TrainSettings
from harness.compare.result import ERROR, EXIT_CODES
from harness.optimizers import DEFAULT, OPTIMIZERS, Optimizer
from harness.pipeline import run_folder
from harness.report import train_matrix_report
from harness.run import workers

ALIGNED = {"weight_decay_params": "not_1d", "expert_bias_update": "off"}


def knobs_for(runners, optimizer: Optimizer = OPTIMIZERS[DEFAULT]) -> list[dict]:
    """The settings worth a cell for this pair and optimizer: each a {train field: value} over the case's own (the
    optimizer's stack fields from its record)."""
    cells = [{"weight_decay_params": "not_1d"}, {"weight_decay_params": "all"}]
    if "megatron_model" in runners:
        cells += [{"expert_bias_update": "off"}] + ([{"distributed_optimizer": True}]
                                                    if optimizer.distributed_optimizer else [])
    for runner, stack_cells in optimizer.matrix.items():
        cells += list(stack_cells) if runner in runners else []
    return cells + [{"clip_grad": 0.0}, dict(ALIGNED), {**ALIGNED, "clip_grad": 0.0}]


def run(name: str, options: pipeline.CompareOptions = pipeline.DEFAULT_OPTIONS, knobs: list[dict] | None = None) -> int:
    case = Registry.load(Path(options.cases_dir)).get(name)
    runners = options.runners or case.runners
    settings = [{}] + (knobs if knobs is not None else knobs_for(runners, case.train.record))
    _, matrix_dir = run_folder.new_run_dir(Path(options.reports_dir), f"{name}-knob-matrix")
    cells = []
    with workers.fresh_processes(options.fresh_process), workers.serving(matrix_dir / "workers"):
        for setting in settings:
            train = TrainSettings.from_dict({**case.train.to_dict(), **setting})  # a setting is a train field
            result, run_dir = pipeline.compare_case(
                name, replace(options, config_overrides={**options.config_overrides, "train": train.to_dict()}))
            cells.append({"setting": setting, "verdict": result.verdict, "message": result.message,
                          "sides": " vs ".join(result.case.get("runners", ())),
                          "first_divergence": (result.train or {}).get("first_divergence"),
                          "differing": differing_per_quantity(result.train), "report": str(run_dir / "report.md")})
    (matrix_dir / "matrix.json").write_text(json.dumps({"case": name, "cells": cells}, indent=2) + "\n")
    train_matrix_report.write(name, cells, matrix_dir)
    train_matrix_report.console(name, cells, matrix_dir)
    return EXIT_CODES[ERROR] if any(c["verdict"] == ERROR for c in cells) else 0


def differing_per_quantity(train: dict) -> dict[str, int]:
    """Over all steps: per quantity, the tensors (scalars: the steps) whose bits differ."""
    counts: dict[str, int] = {}
    for step in (train or {}).get("steps", []):
        for quantity, scalar in step["scalars"].items():
            counts[quantity] = counts.get(quantity, 0) + (1 if scalar["equal"] is False else 0)
        for quantity, q in step["quantities"].items():
            counts[quantity] = counts.get(quantity, 0) + q["total"] - q["equal"]
    return counts
