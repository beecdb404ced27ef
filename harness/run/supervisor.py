"""Every process a run starts, and how they all end: the one place for signals and escaped descendants.

- ``register``/``unregister``: the runner processes (each the leader of its own process group) now running.
- ``install`` (the command line does this, in the main thread): SIGINT, SIGTERM and SIGHUP stop every runner's
  whole process group and every other process started since at once (SIGKILL), then raise ``Interrupted`` in the main
  thread, so the run ends at once with a report saying it was interrupted, and exit code 128 + the signal.
  It also makes the harness a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a process a runner
  starts in a session of its own (a daemon) is re-parented to the harness instead of init, so it stays findable.
- ``watch()`` around a round of runners: whatever the round started that still runs when it ends (a daemon, an
  orphaned grandchild) is killed and reaped. A process registered with ``keep=True`` (a worker meant to outlive
  one round) is spared by ``watch`` but still stopped by a signal. Rounds may run at once in several threads
  (``nightly --workers``): a round owns the runners registered from its own thread, and its sweep spares every
  runner another round still has registered, with that runner's descendants.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from harness.run import launch

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37

_lock = threading.RLock()  # re-entrant: a signal handler may run while the main thread holds it
_live: dict[int, tuple[subprocess.Popen, bool]] = {}  # pid -> (process, keep across rounds)
_round = threading.local()  # .processes: the runners registered by the round this thread is watching
_state = {"installed": False, "interrupted": None, "previous_handlers": {}, "subreaper": None, "before": set(),
          "stopped": []}


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not caught by `except Exception`
    """The run was stopped by a signal; its runners are already gone. `report` is set once one is written."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.report = signum, None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return (f"interrupted by {self.name}: the run was stopped, every runner's process group killed; "
                "no verdict")


def register(process: subprocess.Popen, keep: bool = False) -> None:
    with _lock:
        _live[process.pid] = (process, keep)
    if getattr(_round, "processes", None) is not None:
        _round.processes.append(process)


@contextmanager
def starting() -> Iterator[None]:
    """Around starting and registering a runner: another round's sweep never sees it started but not registered."""
    with _lock:
        yield


def unregister(process: subprocess.Popen) -> None:
    with _lock:
        _live.pop(process.pid, None)


def interrupted() -> int | None:
    """The signal that stopped this run, if any."""
    return _state["interrupted"]


def take_stopped() -> list[str]:
    """The runner process groups stopped since the last call (by a signal, or an interrupted run)."""
    stopped, _state["stopped"] = list(dict.fromkeys(_state["stopped"])), []
    return stopped


def install() -> None:
    """Signal handlers and the subreaper, for a command-line run (main thread only; elsewhere nothing)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    _state["installed"], _state["interrupted"], _state["before"] = True, None, snapshot()
    _state["stopped"] = []
    for signum in SIGNALS:
        _state["previous_handlers"][signum] = signal.signal(signum, _on_signal)
    _state["subreaper"] = _set_subreaper(True)


def uninstall() -> None:
    """Stop what is left and give the process its previous signal handlers back (tests call main() in-process)."""
    if not _state["installed"]:
        return
    stop_all()
    for signum, handler in _state["previous_handlers"].items():
        signal.signal(signum, handler)
    _state["previous_handlers"].clear()
    if _state["subreaper"] is not None:
        _set_subreaper(bool(_state["subreaper"]))
    _state["installed"], _state["interrupted"], _state["subreaper"] = False, None, None


def _on_signal(signum, frame) -> None:
    first = _state["interrupted"] is None
    if first:
        _state["interrupted"] = signum
    stop_all()
    if first:  # a second Ctrl-C while the report is being written only stops runners again
        raise Interrupted(signum)


def stop_all() -> list[int]:
    """SIGKILL every registered runner's process group and everything below it; under ``install`` also every
    other descendant of the harness started since (a daemon re-parented to it, a runner not yet registered)."""
    with _lock:
        processes = [process for process, _ in _live.values()]
    victims: set[int] = set()
    for process in processes:
        victims |= launch.descendants(process.pid) | {process.pid}
        args = process.args if isinstance(process.args, (list, tuple)) else [process.args]
        _state["stopped"].append(f"process group {process.pid}: {' '.join(map(str, args))}"[:300])
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if _state["installed"]:  # what was already running when the command started (a test's own) is spared
        victims |= {pid for pid, _ in snapshot() - _state["before"]}
    killed = _kill(victims)
    _reap_adopted(victims)
    return killed


def snapshot() -> set[tuple[int, str]]:
    """The harness's descendants now, by (pid, start time)."""
    return _identified(launch.descendants(os.getpid()))


@contextmanager
def watch() -> Iterator[None]:
    """Around one round of runners: afterwards, kill and reap every descendant the round left behind."""
    before = snapshot()
    outer, _round.processes = getattr(_round, "processes", None), []
    try:
        yield
    finally:
        mine, _round.processes = _round.processes, outer
        sweep(before, mine)


def sweep(before: set[tuple[int, str]], mine: list[subprocess.Popen]) -> list[int]:
    """Kill (SIGKILL) and reap descendants that were not there `before`, are not kept workers and belong to no
    other round still running; a runner of this round (`mine`) still registered (its round ended early, e.g. a
    folder could not be written) is stopped, waited for and forgotten, so its process group id is never signalled
    again once the system may have reused it."""
    with _lock:
        orphaned = [process for process in mine if process.pid in _live and not _live[process.pid][1]]
    for process in orphaned:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
        unregister(process)
    with _lock:  # no runner is between its start and its registration meanwhile (`starting`)
        kept = set(_live)  # kept workers, and the runners of rounds other threads are still watching
        kept |= {pid for leader in kept for pid in launch.descendants(leader)}
        leftovers = {pid for pid, started in _identified(launch.descendants(os.getpid())) - before
                     if pid not in kept}
    killed = _kill(leftovers)
    _reap_adopted(leftovers)
    return killed


def _identified(pids: set[int]) -> set[tuple[int, str]]:
    return {(pid, started) for pid in pids if (started := launch.start_time(pid))}


def _kill(pids: set[int]) -> list[int]:
    killed = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _reap_adopted(pids: set[int]) -> None:
    """Wait for killed processes that are our children but not ones a Popen waits for (orphans we adopted as a
    subreaper); a Popen's own child is left to its Popen, which would otherwise read a wrong exit code."""
    with _lock:
        ours = set(_live)
    for pid in pids - ours:
        if _parent(pid) != os.getpid():
            continue
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _set_subreaper(on: bool) -> int | None:
    """Become (or stop being) a child subreaper; returns the previous setting, None where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0) != 0:
            return None
        if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return previous.value
    except (OSError, AttributeError):
        return None
