"""Checks the end-to-end tests make on real runs: what this CPU can run, and report counts recomputed from the
runners' own output files."""

from __future__ import annotations

import numpy as np

from harness.case.ops import OPS
from harness.run.protocol import cpu_isa_flags

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
