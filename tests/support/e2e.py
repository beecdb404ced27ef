"""Checks the end-to-end tests make on real runs: what this CPU can run, report counts recomputed from the runners'
own output files, and the committed baseline record of this platform a run must repeat."""

from __future__ import annotations

import numpy as np

from harness.baselines import records, store
from harness.case.ops import OPS
from harness.report.baseline_section import describe
from harness.run.protocol import cpu_isa_flags, host_provenance

LINEAR_OPS = tuple(name for name, op in OPS.items() if op.oracle == "linear")  # out = x @ W.t(), however viewed


# Ops whose Paddle side runs in dygraph and needs a bf16 kernel Paddle 3.3.1 does not register on any CPU, with the
# kernel its UNSUPPORTED message names (measured): GEMMs, and the elementwise add / scatter of RoPE and the MoE combine.
PADDLE_CPU_BF16_MISSING = {"shared_expert_mlp": "matmul", "attention_scores": "baddbmm", "routed_experts": "matmul",
                           "core_attention": "baddbmm", "lm_head_loss": "matmul", "yarn_rope": "add",
                           "moe_combine": "scatter"}


def paddle_bf16_gemm_unavailable(case) -> bool:
    """The linears' only CPU bf16 GEMM is oneDNN's (static graph), which needs AVX-512; the ops of
    PADDLE_CPU_BF16_MISSING run in dygraph, which lacks their bf16 kernel on any CPU. RMSNorm, SwiGLU, the
    embedding and the router (an fp32 GEMM) need none of them."""
    if "paddle" not in case.runners or case.dtype != "bfloat16":
        return False
    return case.op in PADDLE_CPU_BF16_MISSING or (case.op in LINEAR_OPS and "avx512f" not in cpu_isa_flags())


def assert_counts_match_outputs(report, a, b):
    for tensor in report["tensors"]:
        bits_a, bits_b = (x[tensor["name"]].view(f"u{x[tensor['name']].itemsize}") for x in (a, b))
        differing = np.flatnonzero(bits_a != bits_b)
        assert tensor["mismatches"] == differing.size, tensor["name"]
        if differing.size:
            first = np.unravel_index(differing[0], bits_a.shape)
            assert tensor["first_mismatch"]["index"] == [int(i) for i in first]


def verdict_of(report) -> str:
    """The one verdict the output files give (after assert_counts_match_outputs has recomputed the counts from them):
    what a test of a platform-dependent pair asserts, never "BITWISE_PASS or DIFF"."""
    return "DIFF" if any(t["mismatches"] for t in report["tensors"]) else "BITWISE_PASS"


# The committed baselines (baselines/), loaded once: what an end-to-end test pins a case's verdict to.
COMMITTED = store.load_all(store.BASELINES_DIR)


def this_platform() -> dict:
    return records.platform(host_provenance(), "cpu")


def on_amd_avx512_bf16() -> bool:
    """The platform the model zoo's training divergences were measured on (AMD EPYC with AVX-512 BF16): which tensor
    of a step rounds apart first is pinned there only; elsewhere its step is."""
    platform = this_platform()
    return platform["cpu"] == "AMD EPYC" and "avx512_bf16" in platform["cpu_isa"].split()


def committed_record(case) -> tuple[dict | None, dict | None]:
    """(the record of `case` in this platform's committed baseline, that baseline); None where there is none."""
    table = store.for_platform(COMMITTED, this_platform())
    return ((table or {}).get("cases", {}).get(case.name), table)


def assert_repeats_the_record(case, report: dict, table: dict) -> None:
    """The run gives exactly what this platform's baseline records for the case: same definition, runners, verdict,
    UNSUPPORTED reason, differing tensors and their numbers. Else the failure says how to record it again."""
    entry = {"case": case.name, "verdict": report["verdict"], "message": report["message"], "result": report}
    problems = records.record_problems(entry, table)
    command = store.record_command("cpu", (table.get("recorded_from") or {}).get("tokens"))
    assert not problems, (
        f"{case.name} on {describe(this_platform())} no longer gives what {table['_file']} records: "
        + "; ".join(problems[:8]) + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "")
        + f". If the new verdicts are right, record this platform again: `{command}`, and commit baselines/")


def no_record_reason(case) -> str:
    """Why a case with no stated expectation and no record is not pinned here, and how to pin it."""
    return (f"{case.name}: no stated expectation and no record in this platform's baseline ({describe(this_platform())}"
            f"); the platform-independent checks passed. Record it: `{store.record_command('cpu', 16)}`")
