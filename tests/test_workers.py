"""Runners that stay up across cells (harness.run.workers) compute what a process of their own computes.

The same sweep twice on the real runners (Megatron-Core, Paddle, the oracle): once in workers, once with
``fresh_process``; every cell's outputs must be the same bytes, and each run's meta.json must say where it ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import CompareOptions
from harness.commands.sweep import run_sweep

CASE, TOKENS = "kimi_mla_q_a_fp32", [8, 16]  # float32: every CPU has the kernels


def outputs_by_cell(sweep: dict, sweep_dir: Path) -> dict[tuple[int, str], bytes]:
    return {(cell["tokens"], side["label"]): (sweep_dir / cell["run_dir"] / Path(side["folder"]).name /
                                              "outputs.safetensors").read_bytes()
            for cell in sweep["cells"] for side in cell["sides"]}


@pytest.mark.slow  # every runner twice, as a worker and as a fresh process: 68 s on 2 shared cores (2026-12-06)
@pytest.mark.e2e
def test_workers_write_the_bits_of_fresh_processes(tmp_path, checkpoints_dir):
    def sweep(folder: str, **options):
        return run_sweep(CASE, TOKENS, options=CompareOptions(
            checkpoints_dir=checkpoints_dir, reports_dir=tmp_path / folder, **options), progress=lambda line: None)

    (in_workers, workers_dir), (fresh, fresh_dir) = sweep("workers"), sweep("fresh", fresh_process=True)
    for sweep in (in_workers, fresh):
        assert all(side["status"] == "ok" for cell in sweep["cells"] for side in cell["sides"]), sweep["cells"]
    worker_bits, fresh_bits = outputs_by_cell(in_workers, workers_dir), outputs_by_cell(fresh, fresh_dir)
    assert set(worker_bits) == {(t, label) for t in TOKENS for label in ("a", "b", "oracle")}
    assert worker_bits == fresh_bits
    for cell_number, cell in enumerate(in_workers["cells"], start=1):
        for side in cell["sides"]:
            meta = json.loads((workers_dir / cell["run_dir"] / Path(side["folder"]).name / "meta.json").read_text())
            assert meta["process"]["mode"] == "shared worker" and meta["process"]["cell"] == cell_number, side
    assert {side["meta"]["process"]["mode"] for cell in fresh["cells"] for side in cell["sides"]} == {"fresh process"}
    logs = sorted(p.name.split("-", 2) for p in (workers_dir / "workers").iterdir())  # one worker per runner
    assert sorted(name for _, _, name in logs) == ["megatron.log", "oracle.log", "paddle.log"]
    assert sorted(number for _, number, _ in logs) == ["1", "2", "3"]  # (the oracle starts beside the pair)
