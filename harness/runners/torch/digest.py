"""``bits128v1`` (harness.run.bits128: the definition) in torch, on the device that holds the tensor: the same code on
a CPU and a GPU. A GPU tensor is digested on its GPU, in chunks of words (bounded temporaries), and only its two
64-bit lane sums come to the host, finished on the device first (``finished``: the host formats only the hex digits),
all of a step's tensors in one copy. A tensor can be digested when it is handed over and finished later (``Digested``:
a gradient before clipping scales it in place).

torch has no unsigned 64-bit arithmetic: the words are int64 (the same bits); a product or a sum of int64 wraps
modulo 2^64 in two's complement, which is the unsigned arithmetic's bits; torch's ``>>`` on int64 is arithmetic, so a
logical shift by s is ``(x >> s) & (2^(64 - s) - 1)``. tests/test_bits128.py checks every result against the host
reference.

On a CUDA device where Triton imports, the same arithmetic runs fused in one kernel
(harness.runners.torch.digest_triton: each word read once); ``implementation(device)`` names the path taken.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from harness.run.bits128 import ALGORITHM, KEYS, MASK64, MIXERS, signed

try:  # torch's CUDA builds bring Triton; its CPU builds do not
    from harness.runners.torch import digest_triton
except ImportError:
    digest_triton = None

# words per pass: 2 MB temporaries on a CPU (the fastest of 2^16 .. 2^22 here), 128 MB each on a GPU (3 of them)
CHUNK_WORDS = {"cpu": 1 << 18, "cuda": 1 << 24}
FUSED_BATCH_BYTES = 4 << 30  # the words one Triton launch digests at most (about 20 launches for a 79 GB step)


def _logical_shift(x: torch.Tensor, shift: int, out: torch.Tensor) -> torch.Tensor:
    torch.bitwise_right_shift(x, shift, out=out)
    return out.bitwise_and_((1 << (64 - shift)) - 1)


def _mix_(x: torch.Tensor, lane: int, scratch: torch.Tensor) -> torch.Tensor:
    """``mix_L`` in place on int64 `x` (`scratch`: a tensor of its size)."""
    s1, m1, s2, m2, s3 = MIXERS[lane]
    for shift, multiplier in ((s1, m1), (s2, m2)):
        x.bitwise_xor_(_logical_shift(x, shift, scratch))
        x.mul_(signed(multiplier))
    return x.bitwise_xor_(_logical_shift(x, s3, scratch))


def _words(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The definition's words on the tensor's device: the whole words as a flat int64 view of the tensor's bytes, and
    the zero-padded last word apart where the bytes end in a part of one (no copy of the tensor, but where its bytes
    do not start on an 8-byte boundary of their storage: a piece of a flattened tensor)."""
    if tensor.numel() == 0:  # no words (torch cannot view an empty tensor's bytes)
        return []
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    if raw.storage_offset() % 8:
        raw = raw.clone()
    parts = [raw[:whole].view(torch.int64)] if whole else []
    if whole < raw.numel():
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[:raw.numel() - whole] = raw[whole:]
        parts.append(tail.view(torch.int64))
    return parts


@torch.no_grad()
def lane_sums(tensor: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``[S_0, S_1]`` of `tensor` as an int64 tensor on its device (not copied to the host: no synchronisation); a
    `chunk` (words per pass) forces the torch ops."""
    device = tensor.device
    if _fused(device) and chunk is None:
        return _fused_sums([tensor])[0]
    chunk = chunk or CHUNK_WORDS.get(device.type, CHUNK_WORDS["cuda"])
    parts = _words(tensor)
    size = min(chunk, sum(p.numel() for p in parts))
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    x, t, index = (torch.empty(size, dtype=torch.int64, device=device) for _ in range(3))
    first = 0  # the index of the part's first word
    for words in parts:
        for start in range(0, words.numel(), chunk):
            part = words[start:start + chunk]
            n = part.numel()
            xs, ts, idx = x[:n], t[:n], index[:n]
            torch.arange(first + start, first + start + n, dtype=torch.int64, device=device, out=idx)
            for lane in (0, 1):
                torch.mul(idx, signed(KEYS[lane]), out=xs)
                sums[lane] += _mix_(xs.bitwise_xor_(part), lane, ts).sum()
        first += words.numel()
    return sums


def _fused(device: torch.device) -> bool:
    return device.type == "cuda" and digest_triton is not None


def _fused_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every tensor's ``[S_0, S_1]`` as rows of one int64 tensor, one Triton launch per FUSED_BATCH_BYTES of words (a
    launch per tensor cost more than the digests: 42 us a tensor from Python, thousands a step). A tensor whose bytes
    are contiguous and start on a word is read where it is, by address; the others' words (views made contiguous, a
    zero-padded last word) are copies, held until their batch is queued: the bound keeps them few."""
    sums = torch.zeros((len(tensors), 2), dtype=torch.int64, device=tensors[0].device)
    batch, copies, size = [], [], 0
    for row, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.is_contiguous() and tensor.data_ptr() % 8 == 0 and nbytes % 8 == 0:
            parts = [(tensor.data_ptr(), nbytes // 8)] if nbytes else []
        else:
            words = _words(tensor)
            copies += words
            parts = [(w.data_ptr(), w.numel()) for w in words]
        first = 0
        for address, count in parts:
            batch.append((address, count, first, row))
            first += count
            size += count * 8
        if size >= FUSED_BATCH_BYTES:
            digest_triton.add_lane_sums(batch, sums)
            batch, copies, size = [], [], 0
    digest_triton.add_lane_sums(batch, sums)
    return sums


def implementation(device: torch.device) -> str:
    """Which code digests a tensor on `device` (a run's meta.json says it)."""
    return digest_triton.implementation() if _fused(device) else "bits128v1 in torch elementwise ops"


class Digested(NamedTuple):
    """A tensor digested when it was handed over (a gradient before clipping changes it in place), in place of a copy
    of it: its dtype and shape (what a step file's ``layouts`` say) and its lane sums, still on its device."""

    dtype: torch.dtype
    shape: torch.Size
    sums: torch.Tensor  # [S_0, S_1], int64, on the tensor's device

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@torch.no_grad()
def lane_sums_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every tensor's ``[S_0, S_1]`` as rows of one int64 tensor on their device (all on one: a step's are), not copied
    to the host."""
    device = tensors[0].device
    for tensor in tensors:
        if tensor.device != device:
            raise ValueError(f"digests: a tensor on {tensor.device} among tensors on {device}")
    return _fused_sums(tensors) if _fused(device) else torch.stack([lane_sums(t) for t in tensors])


def digest_now(tensors: dict[str, torch.Tensor]) -> dict[str, Digested]:
    """Each tensor digested now, its lane sums left on its device (no synchronisation): what ``digests`` later
    finishes as the tensor's digest, whatever happened to the tensor in between."""
    if not tensors:
        return {}
    rows = lane_sums_rows(list(tensors.values()))
    return {name: Digested(t.dtype, t.shape, row) for (name, t), row in zip(tensors.items(), rows, strict=True)}


@torch.no_grad()
def digests(tensors) -> list[str]:
    """``bits128v1`` of each tensor (all on one device: a step's are), computed there, or finished from a
    ``Digested``'s lane sums; the lane sums of all of them in one tensor, copied to the host once (a step's thousands
    of tensors: no Python per tensor where none was digested early)."""
    items = list(tensors)
    if not items:
        return []
    fresh = [item for item in items if not isinstance(item, Digested)]
    if len(fresh) == len(items):
        sums = lane_sums_rows(items)
    else:  # rows put in order by one stack (indexing by a list of rows would copy it to the device and wait there)
        made = iter(lane_sums_rows(fresh) if fresh else [])
        sums = torch.stack([item.sums if isinstance(item, Digested) else next(made) for item in items])
    nbytes = [item.nbytes if isinstance(item, Digested) else item.numel() * item.element_size() for item in items]
    return finished(sums, nbytes)


def finished(sums: torch.Tensor, nbytes: list[int]) -> list[str]:
    """The digests of rows of lane sums (``bits128.finish``), finished where the sums are, all at once: only the
    hex formatting is Python per tensor (``finish`` per tensor in Python cost 11 to 22 ms for a step's 3,200 tensors
    on a loaded 2-core host, a tenth of Megatron's per-step overhead at full width)."""
    x = sums ^ torch.tensor(nbytes, dtype=torch.int64, device=sums.device).unsqueeze(1)
    x ^= torch.tensor([signed(k) for k in KEYS], dtype=torch.int64, device=sums.device)
    scratch = torch.empty(len(nbytes), dtype=torch.int64, device=sums.device)
    for lane in (0, 1):
        column = x[:, lane].contiguous()
        x[:, lane] = _mix_(column, lane, scratch)
    return [f"{ALGORITHM}:{h0 & MASK64:016x}{h1 & MASK64:016x}" for h0, h1 in x.cpu().tolist()]


def digest(tensor: torch.Tensor) -> str:
    return digests([tensor])[0]
