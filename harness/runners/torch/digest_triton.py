"""``bits128v1``'s lane sums (harness.run.bits128: the definition) of many CUDA tensors in one fused Triton kernel: each
word is read once and mixed in registers, where torch's elementwise ops (harness.runners.torch.digest) make about 30
passes over int64 temporaries (58 GB/s on an H200: 1.4 s for a full-width Kimi-K2 step's 79 GB, the whole of the
harness's per-step overhead there; docs/speed.md), and one launch serves a batch of tensors (a step digests thousands:
a launch each cost more than the digests).

The arithmetic is the torch implementation's, word for word: int64 (the same bits as the definition's uint64), products
and sums wrapping modulo 2^64, a logical shift as an arithmetic one masked. Each program sums one block of one
tensor's words and adds its two sums atomically into the tensor's row (integer additions: any order gives the same
bits). tests/test_bits128.py's GPU test checks it against the host reference; Triton comes with torch's CUDA builds,
and where it does not import the torch implementation runs instead (``implementation()`` names which, for meta.json).
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
def _add_lane_sums(table, owner, sums, block: tl.constexpr):
    """Program p: block p - start of the words of entry e = owner[p], whose table row is (address, words, index of its
    first word in its tensor, the tensor's row in `sums`, the entry's first program)."""
    program = tl.program_id(0).to(tl.int64)
    entry = tl.load(owner + program).to(tl.int64) * 5
    words = tl.load(table + entry).to(tl.pointer_type(tl.int64))
    n, first = tl.load(table + entry + 1), tl.load(table + entry + 2)
    row, start = tl.load(table + entry + 3), tl.load(table + entry + 4)
    offsets = (program - start) * block + tl.arange(0, block).to(tl.int64)
    inside = offsets < n
    word = tl.load(words + offsets, mask=inside, other=0)
    index = offsets + first
    lane0 = tl.where(inside, _mix((index * K0) ^ word, A1, AM1, A2, AM2, A3), 0)
    lane1 = tl.where(inside, _mix((index * K1) ^ word, B1, BM1, B2, BM2, B3), 0)
    tl.atomic_add(sums + 2 * row, tl.sum(lane0, axis=0))
    tl.atomic_add(sums + 2 * row + 1, tl.sum(lane1, axis=0))


@torch.no_grad()
def add_lane_sums(entries: list[tuple[int, int, int, int]], sums: torch.Tensor) -> None:
    """Add into ``sums[row]`` (an int64 CUDA tensor of shape (rows, 2), contiguous) the lane sums of each entry
    ``(address, words, first, row)``: `words` int64 words at `address` on the same device, the first of them word
    `first` of its tensor. One launch; the caller keeps the memory alive until it is queued (torch's allocator then
    orders any reuse after it on the stream)."""
    if not entries:
        return
    device = sums.device
    blocks = [triton.cdiv(words, BLOCK) for _, words, _, _ in entries]
    starts = [0]
    for count in blocks[:-1]:
        starts.append(starts[-1] + count)
    # made on the host and copied from pinned memory without waiting (a copy from pageable memory waits for the
    # device to finish what it was given: at every launch the host stopped queueing the step's work)
    table = torch.tensor([[*entry, start] for entry, start in zip(entries, starts, strict=True)], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(entries), dtype=torch.int32), torch.tensor(blocks))
    table, owner = (host.pin_memory().to(device, non_blocking=True) for host in (table, owner))
    with torch.cuda.device(device):
        _add_lane_sums[(sum(blocks),)](table, owner, sums, block=BLOCK)


def implementation() -> str:
    return f"bits128v1 in one Triton kernel (triton {triton.__version__})"
