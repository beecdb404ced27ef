"""Truth oracle: the exact result of an op, from the same input bits, with no framework at all.

Why: two frameworks that differ tell a user *that* they differ; the oracle tells which one is closer to
the mathematically exact answer. Every input (bf16, fp16, fp32) converts to float64 exactly; products of
two such values are exact in float64 (at most 48 significant bits); sums accumulate in float64 (BLAS), and
the result is rounded once, to nearest even, to the output dtype. The float64 sum is not exact, so each
element also gets a rigorous error bound (gamma_K times a bound on the terms' magnitudes); where it
reaches across a rounding boundary of the output dtype (both ends of the interval round differently), the
element is recomputed exactly, vectorized: the exact products are split into 32-bit digits on a fixed grid
and summed exactly in integers, then rounded to odd to 53 bits and once more to the output dtype (the proof
sketch is in ``harness/runners/oracle/exact.py``). So every element is the correctly rounded exact value. Intermediate
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

from harness.case.ops import OPS, combine_routing
from harness.run.protocol import OUTPUTS, Phases, Unsupported, read_checkpoint, serve
from harness.runners.oracle import exact

OUTPUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                 "float32": np.dtype(np.float32)}


def run(request: dict, phases: Phases) -> dict:
    record = OPS[request["op"]]
    formula = FORMULAS.get(record.oracle)
    if formula is None:
        covered = sorted(name for name, op in OPS.items() if op.oracle in FORMULAS)
        raise Unsupported(f"no truth oracle for op {request['op']!r} yet (oracles exist for {', '.join(covered)})")
    dtype = OUTPUT_DTYPES[request["dtype"]]
    with phases("setup"):
        tensors = {name: array.astype(np.float64) for name, array in
                   read_checkpoint(request["checkpoint"], load_file).items()}
    outputs, recomputed = {}, {}
    with phases("compute"):
        for name, (left, right, shift, shape) in formula(tensors, request).items():
            outputs[name], recomputed[name] = correctly_rounded_product(left, right, shift, dtype)
            outputs[name] = outputs[name].reshape(shape)
    with phases("write"):
        save_file(outputs, os.path.join(request["output_dir"], OUTPUTS))
    return {"framework": "oracle",
            "implementation": f"numpy float64 products and sums, correctly rounded once to {dtype.name}",
            "versions": {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__}, "blas": _blas_name(),
            "outputs": sorted(outputs), "elements_recomputed_exactly": recomputed}


def linear(tensors: dict[str, np.ndarray], request: dict) -> dict:
    """out = x @ W.T (+ b); grad.input = dY @ W; grad.weight = dY.T @ x; grad.bias = sum of dY over tokens.

    Each output as (left, right, added vector or None, shape): output = left @ right (+ added), exactly, in the
    shape of the tensor it pairs with (out: the upstream gradient's). Tensor parallelism does not change the exact
    function, so every linear-shaped op (column- and row-parallel, per-head projections whose output is [tokens,
    heads, head_dim]) shares it.
    """
    x, w, out_shape = tensors["input"], tensors["weight"], tensors["grad_output"].shape
    dy = tensors["grad_output"].reshape(x.shape[0], w.shape[0])
    bias = tensors["bias"] if request["config"].get("bias", False) else None
    outputs = {"out": (x, w.T, bias, out_shape), "grad.input": (dy, w, None, x.shape),
               "grad.weight": (dy.T, x, None, w.shape)}
    if bias is not None:
        outputs["grad.bias"] = (np.ones((1, dy.shape[0])), dy, None, bias.shape)
    return outputs


def moe_combine(tensors: dict[str, np.ndarray], request: dict) -> dict:
    """out[t] = the sum of token t's routed rows + its shared row: a 0/1 selection matrix times the routed rows
    (expert-major, as both frameworks permute) stacked on the shared ones. The grads are copies of dY: none here."""
    routed, shared = tensors["expert_output"], tensors["shared_output"]
    tokens, experts = shared.shape[0], request["shapes"]["num_experts"]
    routing = np.zeros((tokens, experts), dtype=bool)
    for token, chosen in enumerate(combine_routing(tokens, experts, request["shapes"]["topk"])):
        routing[token, chosen] = True
    token_of_row = np.nonzero(routing.T)[1]  # expert-major, tokens ascending within an expert
    select = np.zeros((tokens, routed.shape[0] + tokens))
    select[token_of_row, np.arange(routed.shape[0])] = 1.0
    select[np.arange(tokens), routed.shape[0] + np.arange(tokens)] = 1.0
    return {"out": (select, np.concatenate([routed, shared]), None, shared.shape)}


def lm_head(tensors: dict[str, np.ndarray], request: dict) -> dict:
    """The logits x @ W.T only: the cross entropy (exp, log) is not a sum of products."""
    x, w = tensors["input"], tensors["weight"]
    return {"intermediate.logits": (x, w.T, None, (x.shape[0], w.shape[0]))}


# The exact functions, by the name an op record gives in its `oracle` field. A formula may cover only some of an
# op's outputs; the report compares those.
FORMULAS = {"linear": linear, "moe_combine": moe_combine, "lm_head": lm_head}


def correctly_rounded_product(left: np.ndarray, right: np.ndarray, shift: np.ndarray | None,
                              dtype: np.dtype) -> tuple[np.ndarray, int]:
    """left @ right (+ shift) rounded once to `dtype`, exact for every element; also how many needed the exact
    path (vectorized exact sums in 32-bit digits; the proof sketch is in harness/runners/oracle/exact.py)."""
    return exact.correctly_rounded_product(left, right, shift, dtype, round_once)


_BITS = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def round_once(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 -> `dtype`, rounded to nearest even exactly once (see the module docstring)."""
    if dtype == np.float32:  # astype, not ascontiguousarray: that makes a scalar (a loss) an array of shape [1]
        return values.astype(np.float32, order="C")
    with np.errstate(over="ignore"):  # beyond the format's range is infinity, as rounding says
        return _to_float32_round_to_odd(values).astype(dtype, order="C")


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


def probe(device: str) -> dict:
    """What would run here (``--probe``): numpy, and each op's formula or that it has none."""
    return {"framework": "numpy", "importable": True, "versions": {"numpy": np.__version__},
            "ops": {name: {"would_run": f"oracle formula {op.oracle!r}"} if op.oracle in FORMULAS else
                    {"would_run": None, "reason": f"no truth oracle for op {name!r}"} for name, op in OPS.items()}}


def main() -> None:
    serve("oracle", run, probe)
