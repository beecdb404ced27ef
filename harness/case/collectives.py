"""The messages of the collectives check (``python -m harness reductions``): what each rank sends, framework-free.

Rank r's message of `size` elements is drawn from its own stream, seeded by (seed, r, size): normal float32 values
rounded once, to nearest even, to the dtype. The ranks' runner (``harness.runners.torch.collectives``) and the truth
(``harness.compare.collectives``) draw the same bits from this one definition.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
# Elements per rank: multiples of 840 (every world size 2..8 divides it, for reduce-scatter's equal shards), from one
# cache line's worth to past the sizes where gloo changes algorithm
SIZES = (840, 53_760, 1_720_320)
WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8)


def message(seed: int, rank: int, size: int, dtype: str) -> np.ndarray:
    """Rank `rank`'s message, in `dtype` (an ml_dtypes bfloat16 array for bfloat16)."""
    values = np.random.default_rng([seed, rank, size]).standard_normal(size, dtype=np.float32)
    return values.astype(DTYPES[dtype])


def problem(sizes: list[int], world: int) -> str:
    """Why reduce-scatter cannot split these sizes over `world` ranks equally ("" when it can)."""
    bad = [size for size in sizes if size % world]
    return f"sizes {bad} are not multiples of the world size {world}" if bad else ""
