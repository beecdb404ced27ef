"""A DeepSeek-V4 run recorded in its own names, as a user's own training code records it (beside the family's
canonical reference, deepseek_v4_2layer_train: tests/test_deepseek_v4.py): docs/examples/zoo/deepseek_v4_reference.py
trains transformers 5.23.0's tiny DeepseekV4ForCausalLM with the recorder, in the environment that holds 5.23.0, and
compare-runs reads it (docs/model.md "DeepSeek-V4")."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import environments
from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "examples" / "zoo" / "deepseek_v4_reference.py"
FLIPPED = "model.layers.1.self_attn.q_a_proj.weight"

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def train(folder: Path, *flip: str) -> Path:
    done = subprocess.run([environments.python("transformers-5.23.0"), str(SCRIPT), str(folder), *flip], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def compare(a: Path, b: Path, reports: Path) -> tuple[int, dict]:
    code = main(["compare-runs", str(a), str(b), "--reports", str(reports)])
    [folder] = reports.iterdir()
    return code, json.loads((folder / "report.json").read_text())


def test_a_deepseek_v4_reference_run_compares_with_a_rerun_and_finds_one_flipped_bit(tmp_path):
    reference = train(tmp_path / "reference")
    meta = json.loads((reference / "meta.json").read_text())
    assert meta["capture"]["config"]["model"]["family"] == "own"
    code, report = compare(reference, train(tmp_path / "again"), tmp_path / "same")
    assert (code, report["verdict"], len(report["tensors"])) == (0, "BITWISE_PASS", 520), report["verdict"]
    code, report = compare(reference, train(tmp_path / "flipped", "--flip", FLIPPED), tmp_path / "flip")
    assert (code, report["verdict"]) == (1, "DIFF")
    assert report["train"]["first_divergence"]["step"] == 1 and report["train"]["steps"][0]["verdict"] == "DIFF"
