"""The plain-PyTorch runners (torch: TN layout, torch_nn: NN layout) against the real Megatron-Core and Paddle.

`torch` makes the same torch calls as Megatron's layer at TP=1 (x @ W.t(), dy @ W, dy.t() @ x), so against
Megatron it must be bitwise equal on any device; `torch_nn` runs other GEMMs, so its verdict is whatever the
kernels give, and the test checks that the report's counts are what the output files say.
"""

import json

import pytest

from conftest import E2E_TOKENS
from harness import CompareOptions, compare_case
from harness.case.checkpoints import load_tensors
from tests.support.e2e import assert_counts_match_outputs, verdict_of

pytestmark = pytest.mark.e2e


def run(case, runners, checkpoints_dir, tmp_path):
    result, run_dir = compare_case(case, CompareOptions(tokens=E2E_TOKENS, runners=runners,
                                                        checkpoints_dir=checkpoints_dir, reports_dir=tmp_path,
                                                        oracle=False))  # the runner pair is under test
    report = json.loads((run_dir / "report.json").read_text())
    tails = "\n".join(s["stderr_tail"][-1500:] for s in report["sides"])
    assert [s.status for s in result.sides] == ["ok", "ok"], f"{result.message}\n{tails}"
    outputs = [load_tensors(run_dir / f"{s['label']}-{s['runner']}" / "outputs.safetensors") for s in report["sides"]]
    assert_counts_match_outputs(report, *outputs)
    assert f"a = `{runners[0]}` vs b = `{runners[1]}`" in (run_dir / "report.md").read_text()
    return result, report


@pytest.mark.parametrize("case", ["kimi_shared_fc1", "kimi_shared_fc1_fp32"])
def test_torch_tn_is_bitwise_megatron(case, checkpoints_dir, tmp_path):
    result, report = run(case, ("megatron", "torch"), checkpoints_dir, tmp_path)
    assert result.verdict == "BITWISE_PASS", result.message
    assert report["sides"][1]["meta"]["weight_layout"] == "tn"
    assert report["expectation"]["met"] and result.exit_code == 0


@pytest.mark.parametrize("case", ["kimi_shared_fc1", "kimi_shared_fc1_fp32"])
def test_torch_nn_against_megatron_reports_what_the_kernels_gave(case, checkpoints_dir, tmp_path):
    result, report = run(case, ("megatron", "torch_nn"), checkpoints_dir, tmp_path)
    assert result.verdict == verdict_of(report), result.message  # the files' counts: run() recomputed them
    meta = report["sides"][1]["meta"]
    assert meta["weight_layout"] == "nn" and "NN GEMM" in meta["implementation"]
    assert report["case"]["runners"] == ["megatron", "torch_nn"]


# torch_nn's pair is the second tier's (18 s on 2 shared cores, 2026-12-06); plain torch's stays here.
@pytest.mark.parametrize("runner", ["torch", pytest.param("torch_nn", marks=pytest.mark.slow)])
def test_torch_against_paddle_fp32(runner, checkpoints_dir, tmp_path):
    result, report = run("kimi_shared_fc1_fp32", (runner, "paddle"), checkpoints_dir, tmp_path)
    assert result.verdict == verdict_of(report), result.message  # the files' counts: run() recomputed them
    assert report["sides"][1]["meta"]["framework"] == "paddle"
    # The case states DIFF for megatron vs paddle; another pair is judged bitwise, so the expectation is reset.
    assert report["expectation"]["verdict"] == "BITWISE_PASS"
