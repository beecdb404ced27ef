"""Where a cell runs when several run at once: its own GPUs on a multi-GPU host.

``run_cells(items, work, workers=N, device=..., tp_of=...)`` runs ``work(item)`` for every item on N threads
(each cell is an ordinary ``compare_case``: its runners are subprocesses, so threads only wait). On a GPU host a
cell takes ``tp_of(item)`` GPUs (a side's ranks: tp, times dp for a training run) of the ones this process was given
(``CUDA_VISIBLE_DEVICES``, else every GPU that ``nvidia-smi -L`` lists), waiting until that many are free, and its
runners see only those (``CUDA_VISIBLE_DEVICES`` set for them through ``runner_env_overrides``). ``cells_per_gpu=K``
lets up to K cells share a GPU (``--cells-per-gpu``: a catalogue's cells use a fraction of an H200 each and spend
most of their wall in their processes' host work): each cell's runners are processes of their own, whose kernels give
the same bits beside a neighbour (the determinism settings forbid the kernels whose results depend on timing); what
they share is the GPU's memory and time, so a cell that does not fit beside its neighbours ends ERROR, never with other
bits (so far an argument, not a measurement: the one GPU runs with shared GPUs, the catalogue bench's, had no Paddle
side and compared nothing). A TP cell's GPUs are still distinct. On the CPU the cells
share the cores: their runners' thread count stays the harness's fixed one (``orchestrate.RUNNER_THREADS``), since the
count can change bits and ``--workers`` must not. Results come back in the items' order.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Environment set for the runners this thread starts (read by orchestrate.runner_env); empty: none.
RUNNER_ENV: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("runner_env", default=None)


def runner_env_overrides() -> dict[str, str]:
    return dict(RUNNER_ENV.get() or {})


@contextlib.contextmanager
def runner_env(values: dict[str, str]) -> Iterator[None]:
    token = RUNNER_ENV.set({**(RUNNER_ENV.get() or {}), **values})
    try:
        yield
    finally:
        RUNNER_ENV.reset(token)


class PlacementError(ValueError):
    """A cell that can never be placed (more GPUs than this process was given); the message says which."""


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set (empty: none), else nvidia-smi's list."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


class GpuPool:
    """Hands out GPUs: `take(n)` blocks until n distinct GPUs each have a free slot (`cells_per_gpu` slots a GPU) and
    returns them (the least used first, then lowest ids)."""

    def __init__(self, gpus: Sequence[str], cells_per_gpu: int = 1):
        if cells_per_gpu < 1:
            raise PlacementError(f"cells per GPU must be at least 1 (got {cells_per_gpu})")
        self.slots = dict.fromkeys(gpus, cells_per_gpu)  # GPU -> free slots
        self.total = len(self.slots)
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def take(self, count: int) -> Iterator[list[str]]:
        if count > self.total:
            raise PlacementError(f"a cell needs {count} GPUs, this process was given {self.total} "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        with self.changed:
            self.changed.wait_for(lambda: sum(free > 0 for free in self.slots.values()) >= count)
            least_used = sorted((gpu for gpu, free in self.slots.items() if free),
                                key=lambda gpu: (-self.slots[gpu], _gpu_order(gpu)))
            taken = sorted(least_used[:count], key=_gpu_order)
            for gpu in taken:
                self.slots[gpu] -= 1
        try:
            yield taken
        finally:
            with self.changed:
                for gpu in taken:
                    self.slots[gpu] += 1
                self.changed.notify_all()


def _gpu_order(gpu: str):
    return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)


def run_cells(items: Sequence[T], work: Callable[[T], R], *, workers: int, device: str,
              tp_of: Callable[[T], int] = lambda item: 1, gpus: Sequence[str] | None = None,
              on_error: Callable[[T, Exception], R] | None = None, cells_per_gpu: int = 1) -> list[R]:
    """`work(item)` for every item, `workers` at a time, each placed as the module docstring says."""
    workers = max(1, workers)
    if workers == 1 and gpus is None:  # one cell at a time: today's behaviour, every GPU visible to each cell
        return [_guarded(work, item, on_error) for item in items]
    pool = GpuPool(visible_gpus() if gpus is None else gpus, cells_per_gpu) if device == "gpu" else None
    if pool is not None and pool.total:
        workers = min(workers, pool.total * cells_per_gpu)

    def one(item: T) -> R:
        try:
            if pool is None or not pool.total:  # no GPU listed: run as before (the runners say what is missing)
                return work(item)
            with pool.take(tp_of(item)) as taken, runner_env({"CUDA_VISIBLE_DEVICES": ",".join(taken)}):
                return work(item)
        except Exception as error:
            if on_error is None:
                raise
            return on_error(item, error)

    if workers == 1:
        return [one(item) for item in items]
    contexts = [contextvars.copy_context() for _ in items]  # the caller's settings (its runner workers) go along
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cell") as executor:
        return list(executor.map(lambda context, item: context.run(one, item), contexts, items))


def _guarded(work: Callable[[T], R], item: T, on_error: Callable[[T, Exception], R] | None) -> R:
    try:
        return work(item)
    except Exception as error:
        if on_error is None:
            raise
        return on_error(item, error)
