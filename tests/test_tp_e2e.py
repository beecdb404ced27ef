"""TP=2 against TP=1 within one framework, with the real runners (Megatron under torchrun, Paddle under its launcher).

The comparison has no expectation (TP invariance is a finding); what is checked is that the report's
TP-invariant and not-TP-invariant lists are exactly what the two sides' gathered output files say, bit for bit,
and that the exit code follows the verdict.
"""

import json

import numpy as np
import pytest

from conftest import E2E_TOKENS
from harness import CompareOptions, Versus, compare_case
from harness.case.checkpoints import load_tensors
from harness.compare.result import EXIT_CODES

pytestmark = pytest.mark.e2e


# Paddle's tensor-parallel pair is the second tier's (27.5 s on 2 shared cores, 2026-12-06); Megatron's stays here.
@pytest.mark.parametrize("runner", ["megatron", pytest.param("paddle", marks=pytest.mark.slow)])
def test_tp2_versus_tp1_lists_the_tp_invariant_tensors(runner, checkpoints_dir, tmp_path):
    result, run_dir = compare_case("kimi_shared_fc2_fp32_tp2", CompareOptions(
        tokens=E2E_TOKENS, versus=Versus("tp", 1, runner), checkpoints_dir=checkpoints_dir, reports_dir=tmp_path))
    report = json.loads((run_dir / "report.json").read_text())
    assert result.verdict != "ERROR", f"{result.message}\n{report['sides'][0]['stderr_tail']}"
    a, b = (load_tensors(run_dir / f"{label}-{runner}-tp{tp}" / "outputs.safetensors") for label, tp in (("a", 2),
                                                                                                        ("b", 1)))
    equal = sorted(n for n in a if np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)))
    assert result.verdict == ("BITWISE_PASS" if len(equal) == len(a) else "DIFF"), result.message  # the files'
    assert result.exit_code == EXIT_CODES[result.verdict] and report["expectation"] == {}
    comparison = report["comparison"]
    assert (comparison["tp_a"], comparison["tp_b"], comparison["runner"]) == (2, 1, runner)
    assert sorted(comparison["tp_invariant"]) == equal
    assert sorted(comparison["not_tp_invariant"]) == sorted(set(a) - set(equal))
    assert report["sides"][0]["meta"]["launch"]["tp"] == 2 and "launch" not in report["sides"][1]["meta"]
    gather = report["sides"][0]["meta"]["gather"]
    assert gather["out"]["identical_across_ranks"] and gather["grad.input"]["split_dim"] == 1
    assert "TP-invariant (bitwise equal)" in (run_dir / "report.md").read_text()
