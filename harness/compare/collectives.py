"""The collectives check's truth: each element of a reduction against the correctly rounded sum of the ranks'
messages (the op oracle's exact path, ``harness.runners.oracle.exact``: the sum as a product with a row of ones,
every element the exact value rounded once); an all-gather against the messages themselves, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.case.checkpoints import load_tensors
from harness.case.collectives import DTYPES, message
from harness.compare.tensors import compare_tensor
from harness.runners.oracle.exact import correctly_rounded_product
from harness.runners.oracle.runner import round_once


def correctly_rounded_sum(messages: list[np.ndarray], dtype: str) -> np.ndarray:
    """The elementwise sum of the messages, exact, rounded once to `dtype`."""
    stacked = np.stack([m.astype(np.float64) for m in messages])
    ones = np.ones((1, len(messages)))
    return correctly_rounded_product(ones, stacked, None, DTYPES[dtype], round_once)[0][0]


def check(folder: Path, seed: int, world: int, dtypes: list[str], sizes: list[int]) -> list[dict]:
    """One row per (collective, dtype, size): elements, how many on any rank differ from the truth, their max ULP
    (raw, and at the result's own scale: a cancelling sum's raw ULPs explode near zero), and whether the ranks agree:
    every rank the same bits, or for reduce-scatter each rank's shard the all-reduce's bits there."""
    ranks = [load_tensors(folder / f"outputs.rank{rank}.safetensors") for rank in range(world)]
    rows = []
    for dtype in dtypes:
        for size in sizes:
            messages = [message(seed, rank, size, dtype) for rank in range(world)]
            total = correctly_rounded_sum(messages, dtype)
            shard = size // world
            truths = {"all_reduce": [total] * world,
                      "reduce_scatter": [total[r * shard:(r + 1) * shard] for r in range(world)],
                      "all_gather": [np.concatenate(messages)] * world}
            for name, truth in truths.items():
                key = f"{name}.{dtype}.{size}"
                found = [compare_tensor(key, ranks[r][key], truth[r]) for r in range(world)]
                agree = all(_same_bits(ranks[0][key], ranks[r][key]) for r in range(world)) \
                    if name != "reduce_scatter" else all(  # a shard: the all-reduce's bits there?
                        _same_bits(ranks[r][key], ranks[r][f"all_reduce.{dtype}.{size}"][r * shard:(r + 1) * shard])
                        for r in range(world))
                rows.append({"collective": name, "dtype": dtype, "size": size, "world": world,
                             "elements": sum(c.elements for c in found),
                             "mismatches": sum(c.mismatches for c in found),
                             "max_ulp": max(c.max_ulp for c in found),
                             "max_error_in_scale_ulps": max(c.max_error_in_scale_ulps for c in found),
                             "ranks_agree": agree,
                             "status": "DIFF" if any(c.status != "EQUAL" for c in found) else "EQUAL"})
    return rows


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                 np.ascontiguousarray(b).view(np.uint8))
