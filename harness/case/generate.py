"""A case's deterministic tensors, drawn in blocks that threads make at once.

Each tensor draws from its own stream, seeded by (case seed, crc32 of its name): adding a tensor moves no other.
Up to ``BLOCK`` elements a tensor is one draw from that stream (generator version 1). A bigger one (only the GPU
catalogue's full-size cases have one: Kimi-K2's 163840 x 7168 embedding table, attention inputs at thousands of
tokens) is drawn in blocks of ``BLOCK`` elements: block 0 is the first ``BLOCK`` elements of that same stream, block
k > 0 draws from its own stream seeded by (seed, crc32 of the name, k) (generator version 2). Blocks are independent,
so threads draw them at once (numpy's generators release the GIL while they fill), and the bits do not depend on how
many threads there are. Each block is filled through a small float32 scratch buffer: no tensor-sized temporary.

Values: normal, float32 draws times std plus mean, in float32; uniform, float64 draws rounded to float32; then each
rounded once, to nearest even, to the tensor's dtype. Integer ids are drawn whole (they are token-sized); labels are
the next token of their ids, -100 at the end.
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from harness.bits import format_of
from harness.case.registry import Case
from harness.case.specs import resolve_dtype

BLOCK = 1 << 25  # elements per block: every CPU case's tensors fit one, so their bits are version 1's
SCRATCH = 1 << 20  # elements per float32 scratch buffer inside a block
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, eq=False)
class Plan:
    """How one tensor is made: drawn from `dist`, derived from `ids` (labels), or an imported `array` as it is."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    seed: int
    dist: dict | None = None
    ids: Plan | None = None
    array: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def blocks(self) -> range:
        """The first element of each block (one block, possibly empty, for a tensor of at most BLOCK elements)."""
        drawn_in_blocks = self.dist is not None and self.dist["dist"] != "randint"
        return range(0, max(self.size, 1), BLOCK if drawn_in_blocks else max(self.size, 1))


def plans(case: Case, imported: dict[str, np.ndarray] | None = None) -> dict[str, Plan]:
    """Every input tensor of `case`, by name, in the op's order; `imported` arrays stand for their tensors."""
    imported = imported or {}
    found: dict[str, Plan] = {}
    for spec in case.input_specs():
        if spec.name in imported:
            array = imported[spec.name]
            found[spec.name] = Plan(spec.name, spec.shape, array.dtype, case.seed, array=array)
        elif spec.role == "labels":  # the next token of each position (step{k}.mb{m}.labels: that micro-batch's ids)
            ids = found[spec.name.removesuffix("labels") + "input_ids"]
            found[spec.name] = Plan(spec.name, spec.shape, np.dtype(np.int64), case.seed, ids=ids)
        else:
            dist = case.tensors[spec.name]
            dtype = np.dtype(np.int64) if dist["dist"] == "randint" else np.dtype(
                format_of(resolve_dtype(spec.dtype, case.dtype)).float_dtype)
            found[spec.name] = Plan(spec.name, spec.shape, dtype, case.seed, dist=dist)
    return found


def version(made: list[Plan]) -> int:
    """The generator version that names these tensors' bits: 1 unless one of them is drawn in several blocks."""
    return 2 if any(len(plan.blocks()) > 1 for plan in made) else 1


def generate(case: Case) -> dict[str, np.ndarray]:
    """Every input tensor of `case` in memory (small cases, tests); checkpoints stream theirs (``blocks_in_order``)."""
    return {name: draw(plan) for name, plan in plans(case).items()}


def draw(plan: Plan) -> np.ndarray:
    """One whole tensor, in its shape."""
    parts = [draw_block(plan, start) for start in plan.blocks()]
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(plan.shape)


def draw_block(plan: Plan, start: int, into: np.ndarray | None = None) -> np.ndarray:
    """The flat elements of `plan` from `start` to the end of its block; a drawn block is filled into the bytes of
    `into` when given (a buffer the caller reuses: no fresh pages to fault in for every block)."""
    if plan.array is not None:
        return np.ascontiguousarray(plan.array).reshape(-1)
    if plan.ids is not None:
        ids = draw(plan.ids).reshape(-1)
        return np.concatenate([ids[1:], np.array([-100], dtype=np.int64)])[:plan.size]
    block = start // BLOCK
    rng = np.random.default_rng([plan.seed, zlib.crc32(plan.name.encode())] + ([block] if block else []))
    if plan.dist["dist"] == "randint":
        return rng.integers(0, int(plan.dist["high"]), plan.size, dtype=np.int64)
    count = min(BLOCK, plan.size - start)
    out = np.empty(count, plan.dtype) if into is None else into[:count * plan.dtype.itemsize].view(plan.dtype)
    scratch = np.empty(min(SCRATCH, out.size), np.float32)
    for low in range(0, out.size, SCRATCH):
        values = scratch[:min(SCRATCH, out.size - low)]
        if plan.dist["dist"] == "normal":
            rng.standard_normal(values.size, dtype=np.float32, out=values)
            values *= plan.dist["std"]  # float32 arithmetic, as `values * std + mean` on a float32 array
            values += plan.dist["mean"]
        else:
            values[:] = rng.uniform(plan.dist["low"], plan.dist["high"], values.size)  # float64, rounded to float32
        _round_into(values, out[low:low + values.size])
    return out


def _round_into(values: np.ndarray, out: np.ndarray) -> None:
    """float32 `values` rounded to nearest even into `out`'s dtype. bfloat16 by integer arithmetic on the bits (the
    top 16 of a float32, rounded on the low 16): the same bits as ml_dtypes' cast for every finite value, and, unlike
    that cast, it releases the GIL, so blocks round in parallel."""
    if out.dtype != BFLOAT16:
        out[:] = values
        return
    bits = values.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out.view(np.uint16)[:] = rounded


def threads() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def blocks_in_order(made: list[Plan], workers: int | None = None) -> Iterator[tuple[Plan, np.ndarray]]:
    """Every block of every plan, plan after plan and block after block, drawn ahead by `workers` threads with at
    most two blocks per thread in flight, each into a buffer that comes back for a later block once the caller has
    hashed and written it (a yielded block is valid until the caller asks for the next): memory stays bounded
    whatever the tensors' sizes."""
    every = [(plan, start) for plan in made for start in plan.blocks()]
    workers = max(1, min(workers or threads(), len(every)))  # a few small tensors: no idle threads to start
    jobs = iter(every)
    free: list[np.ndarray] = []

    def submit(pool, plan, start):
        need = min(BLOCK, plan.size - start) * plan.dtype.itemsize
        buffer = next((free.pop(i) for i, b in enumerate(free) if b.size >= need), None)
        buffer = np.empty(need, np.uint8) if buffer is None else buffer
        return plan, buffer, pool.submit(draw_block, plan, start, buffer)

    with ThreadPoolExecutor(workers) as pool:
        pending = deque(submit(pool, *job) for job in itertools.islice(jobs, 2 * workers))
        try:
            while pending:
                plan, buffer, future = pending.popleft()
                yield plan, future.result()
                free.append(buffer)
                following = next(jobs, None)
                if following is not None:
                    pending.append(submit(pool, *following))
        finally:  # the caller stopped early (a full disk): drop what was not started
            for _, _, future in pending:
                future.cancel()
