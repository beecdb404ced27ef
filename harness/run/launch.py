"""How a runner is started: directly on one rank, through its framework's own launcher on several (TP > 1, or a
training run's data-parallel ranks: ranks = tp x dp).

- torch-based runners: ``python -m torch.distributed.run --nproc-per-node N`` (gloo on the CPU, NCCL on GPUs).
- paddle's: ``python -m paddle.distributed.launch --nproc_per_node N`` (gloo on the CPU by itself).
Both rendezvous on 127.0.0.1 at a port picked free here, so parallel runs do not collide; neither restarts a
failed rank, and both keep one log per rank under ``<side>/ranks/`` for the report.
Both launchers start their ranks in sessions of their own, so killing the launcher's process group does
not reach them: ``kill_tree`` walks /proc for every descendant and kills those too.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

LAUNCHERS = {"megatron": "torchrun", "paddle": "paddle", "megatron_model": "torchrun", "hf_model": "torchrun",
             "paddle_model": "paddle"}
RANK_LOGS = "ranks"
RANK_TAIL_CHARS = 2500


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(runner: str, python: str, request: Path, tp: int, folder: Path, dp: int = 1) -> tuple[list[str], dict]:
    """The command line for one side, and what to record about its launch (`tp` x `dp` ranks)."""
    module = ["-m", f"harness.runners.{runner}", "--request", str(request)]
    ranks = tp * dp
    if ranks == 1:
        return [python, *module], {"launcher": "none", "tp": 1}
    launcher = LAUNCHERS.get(runner)
    logs, port = folder / RANK_LOGS, free_port()
    sizes = {"tp": tp, **({"dp": dp, "ranks": ranks} if dp > 1 else {})}
    if launcher == "torchrun":
        prefix = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--nnodes", "1",
                  "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
                  "--log-dir", str(logs), "--redirects", "3"]
        return [*prefix, *module], {"launcher": "torchrun", **sizes, "master": f"127.0.0.1:{port}"}
    if launcher == "paddle":
        # paddle's launcher runs a training script that does not end in .py as the command itself
        prefix = [python, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks), "--nnodes", "1",
                  "--master", f"127.0.0.1:{port}", "--max_restart", "0", "--log_dir", str(logs)]
        return [*prefix, python, *module], {"launcher": "paddle.distributed.launch", **sizes,
                                            "master": f"127.0.0.1:{port}"}
    raise ValueError(f"runner {runner!r} has no launcher for several ranks (known: {', '.join(LAUNCHERS)})")


def rank_log(folder: Path, rank: int) -> Path | None:
    """A rank's stderr: torchrun's <logs>/<run>/attempt_0/<rank>/stderr.log, or paddle's workerlog.<rank>."""
    logs = folder / RANK_LOGS
    found = sorted(logs.glob(f"*/attempt_*/{rank}/stderr.log")) + sorted(logs.glob(f"workerlog.{rank}"))
    return found[-1] if found else None


def rank_tails(folder: Path, ranks: int) -> dict[int, str]:
    tails = {}
    for rank in range(ranks):
        path = rank_log(folder, rank)
        if path is not None:
            text = path.read_bytes()[-RANK_TAIL_CHARS:].decode("utf-8", "replace").strip()
            if text:
                tails[rank] = text
    return tails


def failed_rank(launcher_stderr: str) -> str:
    """The rank the launcher blames: torchrun's 'Root Cause' entry, paddle's 'Container rank N status failed'."""
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", launcher_stderr, re.S)
    if root:
        return f"rank {root.group(1)} failed first (exit code {root.group(2)})"
    paddle = re.search(r"Container rank (\d+) status failed .*? code (-?\d+)", launcher_stderr)
    if paddle:
        return f"rank {paddle.group(1)} failed (exit code {paddle.group(2)})"
    return ""


def wait(process: subprocess.Popen, timeout: float) -> tuple[int | None, set[tuple[int, str]]]:
    """Wait for the launcher (None on timeout), noting every descendant seen on the way; a descendant that
    outlives its launcher would otherwise be lost to us once it is re-parented."""
    deadline, seen = time.monotonic() + timeout, set()
    while True:
        seen |= {(pid, started) for pid in descendants(process.pid) if (started := start_time(pid))}
        try:
            return process.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))), seen
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return None, seen


def kill_leftovers(seen: set[tuple[int, str]]) -> list[int]:
    """SIGKILL descendants of a finished launcher that still run (checked by start time, so never a reused pid)."""
    killed = []
    for pid, started in seen:
        if start_time(pid) == started and _running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def kill_tree(process: subprocess.Popen) -> None:
    """SIGTERM the launcher's group and every descendant, give them a moment, then SIGKILL what is left."""
    victims = descendants(process.pid)
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        victims |= descendants(process.pid)
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        if not any(_running(pid) for pid in victims):
            return
        time.sleep(0.2)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`: through each thread's list of children in /proc (Linux 3.5+), which reads the
    subtree alone, else through the parent id of every process in /proc (a busy host's thousands, several times per
    cell: measurable on a sweep's every cell)."""
    children_of = _children if _children_lists() else _children_from_every_parent()
    found, todo = set(), [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@functools.cache
def _children_lists() -> bool:
    return Path(f"/proc/self/task/{os.getpid()}/children").exists()


def _children(pid: int) -> list[int]:
    """`pid`'s children, from the children list of each of its threads (a child is listed under the thread that
    started it)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone meanwhile
        return found
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def _children_from_every_parent():
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    return lambda pid: children.get(pid, [])


def start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
