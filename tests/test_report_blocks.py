"""report.md and report.html are one document: both say the same text, block by block, for every report.

The run result here is a test double, named as such (``every_section_result``): hand-built, it holds every
section a run can have (TP launch and invariance, oracle, tolerance, determinism, re-feed, pictures, a failed
side with its stderr tail) and is never a verdict of a real comparison. Each output is read back on its own
(the Markdown by its lines, the HTML by an HTML parser) and the two lists of texts must be equal.
"""

from pathlib import Path

import numpy as np
import pytest

from harness.baselines import trend
from harness.case.tolerance import Tolerance
from harness.compare import tolerance
from harness.compare.result import CaseResult
from harness.compare.tensors import compare_tensor
from harness.report import blocks, case_report, gate_matrix_report, nightly_report, sweep_report
from harness.run.orchestrate import SideResult
from tests.support.report_text import assert_same_text, markdown_texts

SECTIONS = ("TP-invariant (bitwise equal)", "Runners", "Tensors (side a against side b)", "Where the mismatches sit",
            "Re-feed (each op re-run on side b from side a's tensors)", "Distance from the truth oracle",
            "Tolerance policy: NOT met", "Determinism: 2 runs per side", "a.2 (fresh process) against its first run",
            "Provenance", "stderr tail of side b.2 (paddle)", "fake paddle traceback")


def every_section_result(folder: Path) -> CaseResult:
    """Test double: a run result with every report section present (not from a real run)."""
    rng = np.random.default_rng(0)
    out = rng.standard_normal((8, 16)).astype(np.float32)
    flipped = out.copy()
    flipped.view(np.uint32)[2, 3] ^= 1
    flipped.view(np.uint32)[5, 9] ^= 4
    tensors = [compare_tensor("out", flipped, out), compare_tensor("grad.input", out, out),
               compare_tensor("grad.weight", out, out.T.copy())]
    side = {"launch": {"launcher": "torchrun", "tp": 2, "master": "127.0.0.1:29500"},
            "gather": {"out": {"split_dim": 1}, "bias": {"identical_across_ranks": False, "mismatches_vs_rank0": 3}},
            "versions": {"megatron-core": "0.16.1", "torch": "2.9.0"}, "implementation": "ColumnParallelLinear | fp32",
            "onednn_kernels": ["brg:avx512_core", "jit:gemm"]}
    sides = [SideResult("a", "megatron", "ok", folder / "a", "/env/m/python", wall_seconds=1.5, meta=side),
             SideResult("b", "paddle", "ok", folder / "b", "/env/p/python", wall_seconds=2.0,
                        meta={**side, "implementation": "paddle.matmul"}),
             SideResult("oracle", "oracle", "ok", folder / "o", "/env/o/python", meta={"implementation": "float64"}),
             SideResult("b.2", "paddle", "error", folder / "b2", "/env/p/python", reason="exited with code 1\nrank 1",
                        returncode=1, stderr_tail="fake paddle traceback\n```\n  line | 2 <b>\n")]
    as_dicts = [t.to_dict() for t in tensors]
    result = CaseResult(run_id="tiny-20261130-000000-ab12", case_name="tiny", device="cpu",
                        started_at="2026-11-30T00:00:00Z", finished_at="2026-11-30T00:00:09Z")
    result.case = {"runners": ["megatron", "paddle"], "op": "column_parallel_linear", "dtype": "float32", "tp": 2,
                   "tokens": 8, "shapes": {"input_size": 16, "output_size": 8}, "config": {}, "source": "cases/t.toml"}
    result.checkpoint = {"folder": "checkpoints/tiny-abc", "digest": "abc", "generator_version": 1,
                         "perturbed": {"side": "b", "tensor": "input", "bit": 3, "index": [1, 2]}}
    result.sides, result.tensors = sides, tensors
    result.verdict, result.message = "ERROR", "runner b.2 (paddle) failed: exited with code 1 | rank 1"
    result.first_divergence = "out"
    result.expectation = {"stated": True, "verdict": "BITWISE_PASS", "met": False, "problems": ["`out` differs"]}
    result.comparison = {"kind": "tensor_parallel", "runner": "megatron", "tp_a": 1, "tp_b": 2,
                         "tp_invariant": ["grad.input"], "not_tp_invariant": ["out", "grad.weight"]}
    result.versus_oracle = {"status": "ok", "reason": "", "closer": {"out": "b", "grad.input": "tie"},
                            "sides": {"a": {"runner": "megatron", "tensors": as_dicts[:2]},
                                      "b": {"runner": "paddle", "tensors": as_dicts[1:2] + as_dicts[1:2]}}}
    result.versus_oracle["sides"]["b"]["tensors"][0] = {**as_dicts[1], "name": "out"}
    result.repeats = {"runs": 2, "sides": {"a": {"runner": "megatron", "consistent": False, "repeats": [
        {"label": "a.2", "run": 2, "status": "ok", "differing": ["out"], "tensors": as_dicts}]}}}
    result.tolerance = tolerance.judge(Tolerance({"max_ulp": 2}, {"out": {"max_mismatch_share": 0.001}}), tensors)
    result.refeed = {"runner": "paddle", "fed_from": "side a (megatron)", "first_local_divergence": "out",
                     "tensors": {"out": "made by fc2 (differs when re-fed with side a's inputs)"},
                     "stages": [
                         {"stage": "fc1", "op": "linear", "status": "error", "reason": "no kernel", "tensors": []},
                         {"stage": "fc2", "op": "linear", "status": "ok", "reason": "", "tensors": as_dicts[:1]}]}
    result.harness = {"version": "0.0-test", "python": "3.12", "argv": ["harness", "tiny"]}
    return result


def test_run_report_md_and_html_say_the_same_with_every_section(tmp_path):
    result = every_section_result(tmp_path)
    case_report.write(result, tmp_path)
    markdown, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    images = assert_same_text(markdown, page)
    texts = {text for _, text in markdown_texts(markdown)}
    for section in SECTIONS:
        assert any(section in text for text in texts), f"section {section!r} missing from the test double's report"
    assert "](pictures/out.map.png)" in markdown and "](pictures/out.ulp.png)" in markdown
    assert len(images) == 2 and all(i["src"].startswith("data:image/png;base64,") for i in images)
    assert "<h2>Distance from the truth oracle</h2>" in page and "<details><summary>side a: megatron" in page


def test_sweep_gate_matrix_and_nightly_md_and_html_say_the_same(tmp_path):
    tensor = {"status": "DIFF", "mismatches": 3, "mismatch_share": 0.01, "max_ulp": 2}
    sweep = {"case": "tiny", "device": "cpu", "sweep_id": "sweep-tiny-1", "started_at": "s", "finished_at": "f",
             "argv": ["harness", "tiny", "--tokens", "1,7"], "verdicts": {"DIFF": 1, "ERROR": 1}, "exit_code": 2,
             "pairs": ["megatron vs torch"], "tensors": ["out", "grad.input"], "provenance": {"torch": {"torch": "2"}},
             "cells": [{"pair": "megatron vs torch", "tokens": 1, "verdict": "DIFF", "expectation_met": True,
                        "message": "", "wall_seconds": 1.0, "run_dir": "tiny-1", "tensors": {"out": tensor}},
                       {"pair": "megatron vs torch", "tokens": 7, "verdict": "ERROR", "expectation_met": None,
                        "message": "runner a failed | crash", "wall_seconds": 0.5, "run_dir": "tiny-7", "tensors": {}}]}
    sweep_report.write(sweep, tmp_path)
    assert_same_text((tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text())

    cells = [{"use_accuracy_compatible": True, "verdict": "DIFF", "message": "", "sides": "megatron vs paddle",
              "first_divergence": "out", "differing": ["out"], "implementations": ["m", "p"], "report": "r1"},
             {"use_accuracy_compatible": False, "verdict": "UNSUPPORTED", "sides": "megatron vs paddle",
              "message": "kernel `swiglu` is not registered", "first_divergence": None, "differing": [],
              "implementations": ["m", ""], "report": "r2"}]
    gate_matrix_report.write("kimi_swiglu", cells, tmp_path)
    assert_same_text((tmp_path / "matrix.md").read_text(), (tmp_path / "matrix.html").read_text())

    before, night = _night("nightly-1", "pass", "BITWISE_PASS", 0), _night("nightly-2", "fail", "DIFF", 7)
    night.update(tokens=None, started_at="s", finished_at="f", exit_code=1, harness={"version": "0", "host": {}},
                 summary={"failed": 1, "passed": 0, "skipped": 0}, trend=trend.compare(before, night))
    nightly_report.write(night, tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    assert "### New failures (1)" in markdown and "[b paddle] Traceback" in markdown
    assert "## Failures: unmet expectation (1)" in markdown
    assert_same_text(markdown, (tmp_path / "report.html").read_text())


def _night(run_id: str, outcome: str, verdict: str, mismatches: int) -> dict:
    """A one-case night as ``harness.commands.nightly`` stores it (only the fields its report reads)."""
    side = {"label": "b", "runner": "paddle", "status": "error" if mismatches else "ok",
            "stderr_tail": "Traceback\n  boom" if mismatches else "", "meta": {"torch": f"2.{mismatches}"}}
    tensor = {"name": "out", "status": "DIFF" if mismatches else "EQUAL", "mismatches": mismatches, "max_ulp": 3}
    case = {"case": "fc1", "outcome": outcome, "verdict": verdict, "expected": "BITWISE_PASS", "wall_seconds": 1.0,
            "message": f"{mismatches} elements differ", "problems": [f"verdict {verdict}, expected BITWISE_PASS"],
            "report": "cases/fc1/report.md", "failure": "unmet" if outcome == "fail" else None,
            "result": {"case": {"tokens": 16}, "sides": [side], "tensors": [tensor]}}
    return {"schema": 1, "kind": "nightly", "run_id": run_id, "device": "cpu", "cases": [case]}


def test_an_unknown_block_kind_is_an_error_not_a_silent_gap():
    with pytest.raises(ValueError, match="unknown block kind 'quote'"):
        blocks.markdown([("quote", "x")])
    with pytest.raises(ValueError, match="unknown block kind 'quote'"):
        blocks.html([("quote", "x")], "t")
