"""The accuracy-gate matrix: one case run with PaddleFleet's ``use_accuracy_compatible`` on and off.

The gate changes only the Paddle side, so each cell is "Paddle with the gate on/off against side a". Each cell
is an ordinary run with its own report folder; the matrix (matrix.json; matrix.md and matrix.html, rendered by
``harness.report.gate_matrix_report``) lands in a folder of its own that links them. A cell whose path has no
kernel on this device says UNSUPPORTED and names the kernel.
Exit code: 2 if a cell is ERROR, else 0 (the matrix reports differences, it does not judge them).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harness import pipeline
from harness.compare.result import ERROR, EXIT_CODES
from harness.pipeline import run_folder
from harness.report import gate_matrix_report
from harness.run import workers

SETTINGS = (True, False)


def run(name: str, options: pipeline.CompareOptions = pipeline.DEFAULT_OPTIONS) -> int:
    from harness.case.registry import Registry
    from harness.levels import level_of

    if level_of(Registry.load(Path(options.cases_dir)).get(name)).name == "train":  # a training case: its knobs
        from harness.commands import train_matrix
        return train_matrix.run(name, replace(options, oracle=False))
    cells = []
    _, matrix_dir = run_folder.new_run_dir(Path(options.reports_dir), f"{name}-gate-matrix")
    with workers.fresh_processes(options.fresh_process), workers.serving(matrix_dir / "workers"):
        for gate in SETTINGS:
            result, run_dir = pipeline.compare_case(
                name, replace(options, config_overrides={**options.config_overrides, "use_accuracy_compatible": gate}))
            runners = result.case.get("runners", ())
            cells.append({"use_accuracy_compatible": gate, "verdict": result.verdict, "message": result.message,
                          "sides": " vs ".join(runners), "first_divergence": result.first_divergence,
                          "differing": [t.name for t in result.tensors if t.status != "EQUAL"],
                          "implementations": [s.meta.get("implementation", "") for s in result.sides],
                          "report": str(run_dir / "report.md")})
    (matrix_dir / "matrix.json").write_text(json.dumps({"case": name, "cells": cells}, indent=2) + "\n")
    gate_matrix_report.write(name, cells, matrix_dir)
    gate_matrix_report.console(name, cells, matrix_dir)
    return EXIT_CODES[ERROR] if any(c["verdict"] == ERROR for c in cells) else 0
