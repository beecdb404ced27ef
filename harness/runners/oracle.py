"""Truth oracle: the exact result of an op, from the same input bits, with no framework at all.

Why: two frameworks that differ tell a user *that* they differ; the oracle tells which one is closer to
the mathematically exact answer. Every input (bf16, fp16, fp32) converts to float64 exactly; products of
two such values are exact in float64 (at most 48 significant bits); sums accumulate in float64 (error
about K * 2**-53 of the terms' magnitude, far below half an output ULP unless the exact value sits on a
rounding boundary); the result is rounded once, to nearest even, to the output dtype. Intermediate
roundings that the frameworks do (a bf16 GEMM output before the bias add, for instance) are *not*
modelled: the oracle is the exact function, not a third implementation.

Rounding once needs care: ml_dtypes casts float64 to bfloat16 through float32 (double rounding:
1 + 2**-8 + 2**-30 becomes 1.0, not 1 + 2**-7). So float64 goes to float32 with round-to-odd first,
which makes the second rounding (float32 -> bf16/fp16, to nearest even) exact (Boldo & Melquiond).

Ops without an oracle end UNSUPPORTED, saying so. Framework-free: numpy, ml_dtypes, safetensors only.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from harness.runners.protocol import OUTPUTS, Phases, Unsupported, serve

OUTPUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                 "float32": np.dtype(np.float32)}


def run(request: dict, phases: Phases) -> dict:
    op = OPS.get(request["op"])
    if op is None:
        raise Unsupported(f"no truth oracle for op {request['op']!r} yet (oracles exist for {', '.join(OPS)})")
    dtype = OUTPUT_DTYPES[request["dtype"]]
    with phases("setup"):
        tensors = {name: array.astype(np.float64) for name, array in load_file(request["checkpoint"]).items()}
    with phases("compute"):
        exact = op(tensors, request)
        outputs = {name: round_once(values, dtype) for name, values in exact.items()}
    with phases("write"):
        save_file(outputs, os.path.join(request["output_dir"], OUTPUTS))
    return {"framework": "oracle", "implementation": f"numpy float64 accumulation, rounded once to {dtype.name}",
            "versions": {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__},
            "blas": _blas_name()}


def linear(tensors: dict[str, np.ndarray], request: dict) -> dict[str, np.ndarray]:
    """out = x @ W.T (+ b); grad.input = dY @ W; grad.weight = dY.T @ x; grad.bias = sum of dY over tokens.

    Tensor parallelism does not change the exact function, so both parallel linears share it.
    """
    x, w, dy = tensors["input"], tensors["weight"], tensors["grad_output"]
    outputs = {"out": x @ w.T, "grad.input": dy @ w, "grad.weight": dy.T @ x}
    if request["config"].get("bias", False):
        outputs["out"] = outputs["out"] + tensors["bias"]
        outputs["grad.bias"] = dy.sum(axis=0)
    return outputs


OPS = {"column_parallel_linear": linear, "row_parallel_linear": linear}


def round_once(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 -> `dtype`, rounded to nearest even exactly once (see the module docstring)."""
    if dtype == np.float32:
        return np.ascontiguousarray(values.astype(np.float32))
    with np.errstate(over="ignore"):  # beyond the format's range is infinity, as rounding says
        return np.ascontiguousarray(_to_float32_round_to_odd(values).astype(dtype))


def _to_float32_round_to_odd(values: np.ndarray) -> np.ndarray:
    """Truncate toward zero to float32, then set the last bit when anything was cut off (a sticky bit)."""
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = values.astype(np.float32)
        overshot = np.abs(nearest.astype(np.float64)) > np.abs(values)
        truncated = np.where(overshot, np.nextafter(nearest, np.float32(0)), nearest)
        inexact = (truncated.astype(np.float64) != values) & np.isfinite(values)
    raw = truncated.view(np.uint32).copy()
    raw[inexact] |= np.uint32(1)
    return raw.view(np.float32)


def _blas_name() -> str:
    try:
        config = np.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["name"]
    except Exception:  # numpy's config layout is not a stable API; the name is provenance only
        return "unknown"


if __name__ == "__main__":
    serve("oracle", run)
