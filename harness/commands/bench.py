"""``make bench``: the comparator's speed and memory, measured side by side with numpy on the same bytes.

One process pinned to one core; a 4096 x 7168 bf16 tensor (29.4 M elements, the Kimi fc1 weight) against
an equal copy, a copy with 1% of elements 1 ULP off (scattered, like an accumulation-order change), and a
copy where every element differs (a different algorithm). Times are the best of several repeats, in CPU seconds of the
comparing thread (wall seconds beside them); peak memory
is measured separately with tracemalloc (which slows allocation) and given as a multiple of one tensor.
Targets (issue 3): the bitwise check at >= 0.5x numpy.array_equal's throughput; full statistics on this
tensor well under a second.
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc

import ml_dtypes
import numpy as np

from harness import bits
from harness.compare.tensors import bits_equal, compare_tensor


def best_seconds(function, repeats: int) -> tuple[float, float]:
    """Best CPU seconds of this thread and best wall seconds over the repeats.

    CPU time is the headline: on a shared machine wall time mostly measures the neighbours."""
    cpu, wall = [], []
    for _ in range(repeats):
        start_cpu, start_wall = time.thread_time(), time.perf_counter()
        function()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    return min(cpu), min(wall)


def peak_bytes(function) -> int:
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def tensors(rows: int, cols: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    scattered, everywhere = a.copy(), a.copy()
    flat = scattered.reshape(-1).view(np.uint16)
    flat[rng.choice(flat.size, flat.size // 100, replace=False)] ^= np.uint16(1)
    everywhere.reshape(-1).view(np.uint16)[:] ^= np.uint16(1)
    return {"a": a, "equal": a.copy(), "scattered_1pct": scattered, "everywhere": everywhere}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.commands.bench", description=__doc__)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=7168)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    t = tensors(args.rows, args.cols)
    a, equal = t["a"], t["equal"]
    a_bits, equal_bits = bits.as_bits(a).ravel(), bits.as_bits(equal).ravel()
    size = a.nbytes
    print(f"tensor: bfloat16 {list(a.shape)} = {a.size / 1e6:.1f} M elements, {size / 2**20:.0f} MiB per side; "
          f"one core ({os.sched_getaffinity(0) if hasattr(os, 'sched_getaffinity') else 'unpinned'}), "
          f"best of {args.repeats}")

    reference = best_seconds(lambda: np.array_equal(a_bits, equal_bits), args.repeats)
    rows = [("numpy.array_equal, uint16 views (reference)", reference, None),
            ("numpy.array_equal, bfloat16 arrays", best_seconds(lambda: np.array_equal(a, equal), args.repeats), None),
            ("bits_equal (uint64 words, chunked)", best_seconds(lambda: bits_equal(a_bits, equal_bits), args.repeats),
             None)]
    for name in ("equal", "scattered_1pct", "everywhere"):
        other = t[name]
        seconds = best_seconds(lambda other=other: compare_tensor("t", a, other), args.repeats)
        peak = peak_bytes(lambda other=other: compare_tensor("t", a, other))
        rows.append((f"compare_tensor, full statistics, {name}", seconds, peak))

    print(f"{'what':<52} {'cpu s':>8} {'wall s':>8} {'GB/s':>7} {'x array_equal':>14} {'peak / tensor':>14}")
    for what, (cpu, wall), peak in rows:
        memory = f"{peak / size:.2f}" if peak is not None else "-"
        print(f"{what:<52} {cpu:>8.4f} {wall:>8.4f} {2 * size / cpu / 1e9:>7.2f} {reference[0] / cpu:>14.2f} "
              f"{memory:>14}")
    print("GB/s: both sides' bytes per CPU second. x array_equal: throughput relative to numpy.array_equal on the\n"
          "same bytes (uint16 views), higher is faster. peak / tensor: the comparator's own allocations (beyond the\n"
          "two input tensors) over one tensor's bytes.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
