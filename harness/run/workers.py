"""Runners that stay up across cells: a sweep, a nightly, a gate matrix or a repeat starts each runner once.

Starting an interpreter and importing torch + megatron-core or paddle costs seconds; a cell's framework work on the
CPU is a fraction of that. Inside ``serving(folder)`` a TP=1 side is sent to a worker, a runner process started with
``--worker`` (``harness.run.protocol.serve_cells``), one per (runner, interpreter, device, runner environment) and
more when the same key is wanted twice at once. A cell still builds its module afresh from the checkpoint, writes
its own outputs, meta.json (``process``: shared worker, cell number) and logs in its own folder.

Faults: a cell that crashes ends its worker (the next cell gets a new one); a cell past its timeout has its worker's
process group killed, as a process of its own would. Memory: a worker gives its freed heap back after each cell
(``resources.give_back_freed_memory``), and a pool keeps one idle worker a key (more end as their cells do).
Workers are registered with the supervisor as kept (a round's sweep spares them; a signal stops them) and are
stopped when ``serving`` ends. ``fresh_processes()`` turns workers off for what runs inside it (``--fresh-process``,
and the extra fresh repeat of ``--repeat``); TP>1 sides always start fresh under their launcher. Both settings are
context variables: ``placement.run_cells`` carries them into its threads.
"""

from __future__ import annotations

import contextvars
import os
import select
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.run import launch, supervisor
from harness.run.protocol import EXIT_UNSUPPORTED

WORKER_LOG_TAIL = 2000
_lock = threading.Lock()
# The pool sides started in this context use (placement.run_cells carries it into its threads); and whether this
# context starts fresh processes even inside `serving`.
_POOL: contextvars.ContextVar[Pool | None] = contextvars.ContextVar("worker_pool", default=None)
_FRESH: contextvars.ContextVar[bool] = contextvars.ContextVar("fresh_processes", default=False)


@dataclass
class Worker:
    process: subprocess.Popen
    replies: object  # the read end of the reply pipe
    log: Path
    key: tuple
    cells: int = 0
    busy: bool = False

    def describe(self) -> dict:
        return {"mode": "shared worker", "pid": self.process.pid, "cell": self.cells, "log": str(self.log)}


@dataclass
class Pool:
    folder: Path
    started: list[Worker] = field(default_factory=list)

    def acquire(self, key: tuple, name: str, command: list[str], env: dict[str, str], cwd: Path) -> Worker:
        """An idle live worker for `key`, else a new one (its log: ``worker-<n>-<name>.log``)."""
        with _lock:
            for worker in filter(None, self.started):
                alive = worker.process.poll() is None  # for every worker: one that ended (a spare) is reaped
                if alive and worker.key == key and not worker.busy:
                    worker.busy = True
                    return worker
            number = len(self.started) + 1
            self.started.append(None)  # the number is taken; the worker fills it in
        worker = _start(self.folder / f"worker-{number}-{name}.log", key, command, env, cwd)
        with _lock:
            self.started[number - 1] = worker
        return worker

    def close(self) -> None:
        """End every worker: all stdins closed at once (each loop ends), then a group that lingers is killed."""
        started = list(filter(None, self.started))
        for worker in started:
            try:
                worker.process.stdin.close()
            except OSError:
                pass
        for worker in started:
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                launch.kill_tree(worker.process)
            worker.replies.close()
            supervisor.unregister(worker.process)


@contextmanager
def serving(folder: Path) -> Iterator[Pool | None]:
    """Workers for everything run inside, their own logs in `folder`; inside another ``serving``, that one's."""
    if _POOL.get() is not None or _FRESH.get():
        yield _POOL.get()
        return
    pool = Pool(Path(folder))
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)
        pool.close()


@contextmanager
def fresh_processes(on: bool = True) -> Iterator[None]:
    """Sides started inside start processes of their own (when `on`)."""
    token = _FRESH.set(on or _FRESH.get())
    try:
        yield
    finally:
        _FRESH.reset(token)


def active() -> Pool | None:
    return None if _FRESH.get() else _POOL.get()


class Cell:
    """One request sent to a worker; `wait` gives its exit code as a process of its own would have."""

    def __init__(self, worker: Worker, request: Path, pool: Pool):
        self.worker, self.pool = worker, pool
        worker.cells += 1
        self.ran_in = worker.describe()  # meta.json's "process" entry for this cell
        try:
            worker.process.stdin.write(f"{request.resolve()}\n".encode())
            worker.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker is gone; `wait` reads its exit code

    def wait(self, timeout: float) -> int | None:
        """The cell's exit code; None after `timeout` seconds (the worker's process group is then killed)."""
        worker = self.worker
        ready, _, _ = select.select([worker.replies], [], [], max(0.0, timeout))
        if not ready:
            launch.kill_tree(worker.process)
            self._retire()
            return None
        line = worker.replies.readline()
        if not line:  # the worker died in the cell (a segfault, a kill, an import error before its loop)
            code = worker.process.wait()
            self._retire()
            return code
        code = int(line)
        if code in (0, EXIT_UNSUPPORTED):
            self._idle()
        else:  # the worker exits after such a cell (protocol.serve_cells)
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                launch.kill_tree(worker.process)
            self._retire()
        return code

    def log_tail(self) -> str:
        """What the worker wrote outside any cell (its imports' warnings and errors), last part."""
        try:
            return self.worker.log.read_bytes()[-WORKER_LOG_TAIL:].decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def _idle(self) -> None:
        """Back to the pool, or ended where its pool already has an idle worker of its key: a night's case that
        wanted one key three times at once (a float64 case's side b and its two re-fed runs) kept three idle
        workers for the rest of the night, each holding what its imports and caches took (issue 47: a CPU night was
        killed for memory at 24 GiB with 20 workers up)."""
        worker = self.worker
        with _lock:
            spare = any(
                other is not worker and other.key == worker.key and not other.busy and other.process.poll() is None
                for other in filter(None, self.pool.started))
            worker.busy = spare  # a spare is never handed out again
        if spare:  # its loop ends at the end of its stdin; the next acquire reaps it
            try:
                worker.process.stdin.close()
            except OSError:
                pass
            supervisor.unregister(worker.process)  # a signal never stops its group once the pid may be reused

    def _retire(self) -> None:
        supervisor.unregister(self.worker.process)
        with _lock:
            self.worker.busy = True  # never handed out again


def _start(log: Path, key: tuple, command: list[str], env: dict[str, str], cwd: Path) -> Worker:
    log.parent.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    with open(log, "ab") as out, supervisor.starting():
        try:
            process = subprocess.Popen([*command, "--worker", "--reply-fd", str(write_end)], stdin=subprocess.PIPE,
                                       stdout=out, stderr=out, cwd=cwd, env=env, start_new_session=True,
                                       pass_fds=(write_end,))
        except OSError:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        supervisor.register(process, keep=True)
    return Worker(process, os.fdopen(read_end, "rb", buffering=0), log, key, busy=True)
