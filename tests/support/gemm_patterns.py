"""Three kinds of GEMM difference, built with numpy on one bf16 GEMM, for the comparator's pictures.

- ``flipped_bit``: one bit of one output element (the negative control: a single dot).
- ``bf16_accumulation``: the whole GEMM accumulated with the running sum rounded to bf16 every 32 products,
  against the fp32-upcast reference (a different recipe: nearly every element differs).
- ``split_k_tiles``: the reference everywhere except two 128 x 128 output tiles, computed as a split-K of two
  halves each rounded to bf16 before the sum (what a different tiling with a bf16 workspace does).
- ``fp32_split_k``: the whole GEMM as two fp32 halves summed in fp32 (another accumulation order: the
  rounding to bf16 changes only a few scattered elements).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
TILES = ((slice(128, 256), slice(256, 384)), (slice(384, 512), slice(0, 128)))


def operands(m: int = 512, k: int = 1024, n: int = 768, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32).astype(BF16).astype(np.float32)
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(BF16).astype(np.float32)
    return x, w


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """fp32 upcast, one rounding to bf16 at the end."""
    return (x @ w.T).astype(BF16)


def flipped_bit(x, w, index=(300, 500), bit=0) -> np.ndarray:
    out = reference(x, w)
    out.view(np.uint16)[index] ^= np.uint16(1 << bit)
    return out


def bf16_accumulation(x, w, block: int = 32) -> np.ndarray:
    total = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for start in range(0, x.shape[1], block):
        part = x[:, start:start + block] @ w[:, start:start + block].T
        total = (total + part).astype(BF16).astype(np.float32)
    return total.astype(BF16)


def split_k_tiles(x, w) -> np.ndarray:
    out = reference(x, w)
    half = x.shape[1] // 2
    for rows, cols in TILES:
        low = (x[rows, :half] @ w[cols, :half].T).astype(BF16).astype(np.float32)
        high = (x[rows, half:] @ w[cols, half:].T).astype(BF16).astype(np.float32)
        out[rows, cols] = (low + high).astype(BF16)
    return out


def fp32_split_k(x, w) -> np.ndarray:
    half = x.shape[1] // 2
    return (x[:, :half] @ w[:, :half].T + x[:, half:] @ w[:, half:].T).astype(BF16)
