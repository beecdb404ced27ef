"""End to end with the real frameworks: every CPU case of the registry, run by both real runners.

Each case's verdict is pinned on the platform the test runs on, by the first of these that exists:

1. a platform fact the harness knows (Paddle has no bf16 kernel for the op on any CPU, or no bf16 GEMM without
   AVX-512): the Paddle side is UNSUPPORTED and names the kernel;
2. the committed baseline of this platform (baselines/): the case, run at the tokens its record has, repeats the
   record exactly (verdict, UNSUPPORTED reason, differing tensors and their numbers, runner fields);
3. the case's stated expectation, met.

A case with none of them (no expectation, no record: a platform nobody recorded) gets every platform-independent
check (no ERROR, report counts recomputed from the output files, a planted bit reaching exactly where it must, the
first divergence, re-feed) and is then skipped, naming the platform and the command that records it. The report's
counts are recomputed here from the runner output files.
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import E2E_TOKENS
from harness import CompareOptions, compare_case
from harness.case.checkpoints import load_tensors, tensor_sha256
from harness.run.protocol import cpu_isa_flags
from tests.support.e2e import (
    LINEAR_OPS,
    PADDLE_CPU_BF16_MISSING,
    assert_counts_match_outputs,
    assert_repeats_the_record,
    committed_record,
    no_record_reason,
    paddle_bf16_gemm_unavailable,
)
from tests.support.installed import missing_required, on_ci

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("runner_workers")]


def e2e_tokens(case) -> int:
    """A case's own token count when small (the 60-token kernel-choice cases), else E2E_TOKENS."""
    return case.tokens if case.tokens <= 64 else E2E_TOKENS


def hf_file_for(case, folder):
    """A stand-in HF checkpoint with the case's source names (random weights: tests the import path only)."""
    spec, shapes = case.weights_from, {s.name: s.shape for s in case.input_specs()}
    tensors = {}
    rng = np.random.default_rng(0)
    for canonical, names in spec.tensors.items():
        shape = list(shapes[canonical])
        shape[spec.concat_dim] //= len(names)
        for name in names:
            tensors[name] = (rng.standard_normal(shape).astype(np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    save_file(tensors, str(folder / "hf.safetensors"))
    return str(folder / "hf.safetensors")


def test_case_end_to_end(cpu_case, checkpoints_dir, tmp_path):
    known, table = committed_record(cpu_case)
    shipped = cpu_case.weights_from and (cpu_case.weights_from.file or cpu_case.weights_from.package)
    weights = hf_file_for(cpu_case, tmp_path) if cpu_case.weights_from and not shipped else None
    blocks = cpu_case.op_spec.stages is not None
    tokens = known["definition"]["tokens"] if known else e2e_tokens(cpu_case)  # the record's definition
    result, run_dir = compare_case(cpu_case.name, CompareOptions(tokens=tokens, checkpoints_dir=checkpoints_dir,
                                   reports_dir=tmp_path / "reports", weights_file=weights, refeed_ops=blocks))
    report = json.loads((run_dir / "report.json").read_text())
    tails = "\n".join(s["stderr_tail"][-1500:] for s in report["sides"])
    assert result.verdict != "ERROR", f"{result.message}\n{tails}"
    assert report["schema"] == 1 and (run_dir / "report.md").exists()
    if cpu_case.weights_from and cpu_case.weights_from.package:
        assert_weights_came_from_the_package(cpu_case, report)
    for side in report["sides"]:
        assert side["meta"]["runner"] == side["runner"]
        assert side["meta"]["host"]["cpu_isa"] == cpu_isa_flags()

    pinned = pin_verdict(cpu_case, result, report, known, table)
    if result.verdict != "UNSUPPORTED":
        assert_outputs_are_what_the_report_says(cpu_case, report, run_dir, blocks)
    if not pinned:
        pytest.skip(no_record_reason(cpu_case))


def pin_verdict(case, result, report, known, table) -> bool:
    """Assert the verdict the platform fact, the committed record or the stated expectation gives (module docstring);
    False when none applies (nothing pins the case on this platform)."""
    fact = paddle_bf16_gemm_unavailable(case)
    if fact:
        assert result.verdict == "UNSUPPORTED" and result.exit_code == 3, result.message
        assert f"`{PADDLE_CPU_BF16_MISSING.get(case.op, 'matmul')}`" in result.message or (
            case.op in LINEAR_OPS and "matmul" in result.message), result.message
        assert case.op not in LINEAR_OPS or "avx512" in result.message, result.message
    if known is not None:
        assert_repeats_the_record(case, report, table)
        return True
    if fact:
        return True
    if case.expect.stated:
        assert result.expectation["met"], result.expectation["problems"]
        assert result.exit_code == 0
        if result.verdict == "UNSUPPORTED":  # a gate-off path whose kernel this device lacks, or a pinned Paddle
            named = ("not registered", "kernel", "config.paddle_impl = ")  # level missing here: with the reason
            assert any(text in result.message for text in named), result.message
        return True
    missing = missing_required(result.message) if result.verdict == "UNSUPPORTED" else None
    assert not (on_ci() and missing), f"CI installs {missing}, yet: {result.message}"
    assert result.exit_code == {"BITWISE_PASS": 0, "DIFF": 1, "UNSUPPORTED": 3}[result.verdict], result.message
    return False


def assert_outputs_are_what_the_report_says(case, report, run_dir, blocks):
    for side in report["sides"]:
        if side["label"] in ("a", "b"):  # the oracle side says UNSUPPORTED for ops it has no oracle for
            assert side["meta"]["implementation"] and side["meta"]["versions"]
    outputs = [load_tensors(run_dir / f"{s['label']}-{s['runner']}" / "outputs.safetensors") for s in report["sides"]
               if s["label"] in ("a", "b")]  # not the oracle's or a repeat's
    assert_counts_match_outputs(report, *outputs)
    if case.perturb and case.op in LINEAR_OPS:
        assert_mismatches_where_the_flip_reaches(case, report, *outputs)
    if case.perturb and case.op in ("rms_norm", "swiglu"):
        assert_rows_only(report, case.perturb.index[0], *outputs)
    if case.expect.differs:
        order = [s.name for s in case.output_specs()]
        assert report["first_divergence"] == min(case.expect.differs, key=order.index)
    if blocks and report["verdict"] == "DIFF":
        assert_refeed_localizes(case, report)


def assert_mismatches_where_the_flip_reaches(case, report, a, b):
    """out = x @ W.t(): a bit of x[i, j] reaches only row i of out and column j of grad.weight;
    a bit of W[o, i] only column o of out and column i of grad.input."""
    p = case.perturb
    reach = {
        "input": {"out": (0, p.index[0]), "grad.weight": (1, p.index[1])},
        "weight": {"out": (1, p.index[0]), "grad.input": (1, p.index[1])},
    }[p.tensor]
    by_name = {t["name"]: t for t in report["tensors"]}
    for name, (axis, line) in reach.items():
        differing = np.argwhere(a[name].view(f"u{a[name].itemsize}") != b[name].view(f"u{b[name].itemsize}"))
        assert by_name[name]["mismatches"] == len(differing) > 0, name
        where = "row" if axis == 0 else "column"
        assert set(differing[:, axis].tolist()) == {line}, f"{name}: mismatches outside {where} {line}"


def assert_rows_only(report, row, a, b):
    """Row-wise ops (RMSNorm, SwiGLU): a flipped bit in input row i reaches only row i of out and grad.input."""
    for name in ("out", "grad.input"):
        differing = np.argwhere(a[name].view(f"u{a[name].itemsize}") != b[name].view(f"u{b[name].itemsize}"))
        assert len(differing) > 0 and set(differing[:, 0].tolist()) == {row}, name


def assert_refeed_localizes(case, report):
    """Re-feed ran every stage, and the first diverging tensor is one its own op made (nothing upstream of it
    differs, so it cannot have been carried in); tensors the case says stay equal stay equal when re-fed."""
    refeed = report["refeed"]
    assert [s["status"] for s in refeed["stages"]] == ["ok"] * len(refeed["stages"]), refeed["stages"]
    assert refeed["first_local_divergence"] == report["first_divergence"]
    for name in case.expect.equal:
        assert refeed["tensors"][name] == "equal", (name, refeed["tensors"][name])


def assert_weights_came_from_the_package(case, report):
    """The checkpoint's weights are the shipped file's tensors (sha256 of the source tensor before the cast)."""
    manifest = json.loads((Path(report["checkpoint"]["folder"]) / "manifest.json").read_text())
    for canonical, names in case.weights_from.tensors.items():
        source = manifest["recipe"]["imported"][canonical]
        assert case.weights_from.package in source["file"] and source["names"] == list(names)
        with safe_open(source["file"], framework="numpy") as handle:
            original = handle.get_tensor(names[0])
        assert tensor_sha256(original) == source["sha256"]


def test_gate_matrix_runs_both_settings_through_different_paddle_paths(checkpoints_dir, tmp_path):
    """kimi_embedding at the recipe's level: the gate switches Paddle between weight[ids] and F.embedding; both are
    bitwise equal to Megatron's on any platform (a gather, and a sum of whole rows in the backward: what
    kimi_embedding and kimi_embedding_gate_off state). (On a CPU `auto` would take PaddleFormers' level, which has
    no accuracy gate.)"""
    from harness.commands import gate_matrix

    code = gate_matrix.run("kimi_embedding", CompareOptions(checkpoints_dir=checkpoints_dir, reports_dir=tmp_path,
                                                            config_overrides={"paddle_impl": "recipe"}))
    matrix = json.loads(next(tmp_path.glob("*-gate-matrix-*/matrix.json")).read_text())
    assert code == 0 and [c["use_accuracy_compatible"] for c in matrix["cells"]] == [True, False]
    paddle_paths = [c["implementations"][1] for c in matrix["cells"]]
    assert "weight[ids]" in paddle_paths[0] and "functional.embedding" in paddle_paths[1], paddle_paths
    assert [c["verdict"] for c in matrix["cells"]] == ["BITWISE_PASS", "BITWISE_PASS"], matrix["cells"]
