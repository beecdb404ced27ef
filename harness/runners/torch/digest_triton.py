"""``bits128v1``'s lane sums (harness.run.bits128: the definition) on a CUDA tensor in one fused Triton kernel: each
word is read once and mixed in registers, where torch's elementwise ops (harness.runners.torch.digest) make about 30
passes over int64 temporaries (58 GB/s on an H200: 1.4 s for a full-width Kimi-K2 step's 79 GB, the whole of the
harness's per-step overhead there; docs/speed.md).

The arithmetic is the torch implementation's, word for word: int64 (the same bits as the definition's uint64), products
and sums wrapping modulo 2^64, a logical shift as an arithmetic one masked. Each program sums its block of words; the
blocks' sums are added on the GPU (any order: a sum modulo 2^64 has no rounding). tests/test_bits128.py's GPU test
checks it against the host reference; Triton comes with torch's CUDA builds, and where it does not import the torch
implementation runs instead (``implementation()`` names which, for meta.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.run.bits128 import KEYS, MIXERS, signed

BLOCK = 4096  # words per program (32 KB)
# the definition's constants as the kernel's compile-time values (signed: the same bits); few launch arguments keep a
# launch cheap, and a step digests about 3,200 tensors
(_A1, _AM1, _A2, _AM2, _A3), (_B1, _BM1, _B2, _BM2, _B3) = MIXERS
K0, K1 = tl.constexpr(signed(KEYS[0])), tl.constexpr(signed(KEYS[1]))
A1, AM1, A2, AM2, A3 = (tl.constexpr(v) for v in (_A1, signed(_AM1), _A2, signed(_AM2), _A3))
B1, BM1, B2, BM2, B3 = (tl.constexpr(v) for v in (_B1, signed(_BM1), _B2, signed(_BM2), _B3))


@triton.jit
def _mix(x, s1: tl.constexpr, m1: tl.constexpr, s2: tl.constexpr, m2: tl.constexpr, s3: tl.constexpr):
    x ^= (x >> s1) & ((1 << (64 - s1)) - 1)
    x *= m1
    x ^= (x >> s2) & ((1 << (64 - s2)) - 1)
    x *= m2
    return x ^ ((x >> s3) & ((1 << (64 - s3)) - 1))


@triton.jit
def _add_lane_sums(words, n, first, sums, block: tl.constexpr):
    """Each program: its block's two lane sums, added atomically into ``sums[0:2]`` (integer additions: the order of
    the programs changes no bit)."""
    program = tl.program_id(0).to(tl.int64)
    offsets = program * block + tl.arange(0, block).to(tl.int64)
    inside = offsets < n
    word = tl.load(words + offsets, mask=inside, other=0)
    index = offsets + first
    lane0 = tl.where(inside, _mix((index * K0) ^ word, A1, AM1, A2, AM2, A3), 0)
    lane1 = tl.where(inside, _mix((index * K1) ^ word, B1, BM1, B2, BM2, B3), 0)
    tl.atomic_add(sums, tl.sum(lane0, axis=0))
    tl.atomic_add(sums + 1, tl.sum(lane1, axis=0))


@torch.no_grad()
def add_lane_sums(words: torch.Tensor, first: int, sums: torch.Tensor) -> None:
    """Add ``[S_0, S_1]`` of `words` (a flat int64 CUDA tensor, word `first` of its tensor onwards) into `sums` (two
    int64 on the same device, contiguous)."""
    with torch.cuda.device(words.device):
        _add_lane_sums[(triton.cdiv(words.numel(), BLOCK),)](words, words.numel(), first, sums, block=BLOCK)


def implementation() -> str:
    return f"bits128v1 in one Triton kernel (triton {triton.__version__})"
