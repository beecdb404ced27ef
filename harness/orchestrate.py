"""Start runner subprocesses, watch them, and collect what they wrote.

Each runner runs in its own process group (so a timeout kills it and everything it started), with
its own interpreter (``--python NAME=PATH`` or ``HARNESS_PYTHON_<NAME>``, default: this one), and
the repository on ``PYTHONPATH`` so a user's own environment needs no install of the harness.
Both sides start at once and run concurrently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.cases import Case
from harness.checkpoints import Checkpoint, CheckpointError, load_tensors
from harness.runners.protocol import EXIT_UNSUPPORTED, META, OUTPUTS

REPO_ROOT = Path(__file__).resolve().parents[1]
STDERR_TAIL_CHARS = 4000
# Settings of the real alignment runs; recorded by each runner in meta.json.
GPU_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "FLAGS_use_accuracy_compatible_kernel": "1",
           "NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NCCL_NVLS_ENABLE": "0"}


@dataclass
class SideResult:
    label: str  # "a" or "b"
    runner: str
    status: str  # "ok" | "unsupported" | "error"
    folder: Path
    python: str
    reason: str = ""
    returncode: int | None = None
    wall_seconds: float = 0.0
    stderr_tail: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def outputs(self) -> Path:
        return self.folder / OUTPUTS

    def to_dict(self) -> dict:
        return {"label": self.label, "runner": self.runner, "status": self.status, "folder": str(self.folder),
                "python": self.python, "reason": self.reason, "returncode": self.returncode,
                "wall_seconds": round(self.wall_seconds, 3), "stderr_tail": self.stderr_tail, "meta": self.meta}


def runner_python(runner: str, overrides: dict[str, str]) -> str:
    return overrides.get(runner) or os.environ.get(f"HARNESS_PYTHON_{runner.upper()}") or sys.executable


def runner_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # Paddle uses 1 thread unless told
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if device == "gpu":
        for key, value in GPU_ENV.items():
            env.setdefault(key, value)
    return env


def run_pair(case: Case, checkpoint: Checkpoint, device: str, run_dir: Path,
             pythons: dict[str, str], timeout: float) -> list[SideResult]:
    """Run both sides of the case concurrently; never raises for a runner's failure."""
    started = []
    for label, runner in zip("ab", case.runners, strict=True):
        folder = run_dir / f"{label}-{runner}"
        folder.mkdir(parents=True)
        request = _request(case, checkpoint.path_for(label), device, folder)
        (folder / "request.json").write_text(json.dumps(request, indent=2))
        python = runner_python(runner, pythons)
        started.append((label, runner, folder, python, _start(runner, python, folder, device)))
    deadline = time.monotonic() + timeout
    return [_finish(label, runner, folder, python, process, start, deadline, timeout, case)
            for label, runner, folder, python, (process, start) in started]


def run_side(label: str, runner: str, case: Case, inputs: Path, device: str, folder: Path,
             pythons: dict[str, str], timeout: float) -> SideResult:
    """Run one runner alone on an inputs file (re-feed runs one op of a block on one side)."""
    folder.mkdir(parents=True)
    (folder / "request.json").write_text(json.dumps(_request(case, inputs, device, folder), indent=2))
    python = runner_python(runner, pythons)
    process, start = _start(runner, python, folder, device)
    return _finish(label, runner, folder, python, process, start, time.monotonic() + timeout, timeout, case)


def _request(case: Case, checkpoint: Path, device: str, folder: Path) -> dict:
    return {"schema": 1, "case": case.name, "op": case.op, "dtype": case.dtype, "device": device, "tp": case.tp,
            "tokens": case.tokens, "shapes": case.shapes, "config": case.config, "seed": case.seed,
            "checkpoint": str(checkpoint.resolve()), "output_dir": str(folder.resolve())}


def _start(runner: str, python: str, folder: Path, device: str):
    command = [python, "-m", f"harness.runners.{runner}", "--request", str(folder / "request.json")]
    (folder / "command.txt").write_text(" ".join(command) + "\n")
    with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
        try:
            process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                       env=runner_env(device), start_new_session=True)
        except OSError as error:  # e.g. the configured interpreter does not exist
            err.write(f"cannot start {command[0]}: {error}\n".encode())
            process = None
    return process, time.monotonic()


def _finish(label, runner, folder, python, process, start, deadline, timeout, case) -> SideResult:
    side = SideResult(label, runner, "error", folder, python)
    if process is None:
        side.reason = f"could not start interpreter {python!r}"
    else:
        try:
            side.returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(process)
            side.returncode = process.returncode
            side.reason = f"timed out after {timeout:g} s; its process group was killed"
    side.wall_seconds = time.monotonic() - start
    side.stderr_tail = _tail(folder / "stderr.log")
    side.meta = _read_meta(folder)
    if side.reason:
        return side
    if side.returncode == EXIT_UNSUPPORTED and "unsupported" in side.meta:
        side.status, side.reason = "unsupported", side.meta["unsupported"]
    elif side.returncode != 0:
        side.reason = f"exited with code {side.returncode}"
    else:
        problem = _validate_outputs(side, case)
        side.status, side.reason = ("error", f"bad output: {problem}") if problem else ("ok", "")
    return side


def _validate_outputs(side: SideResult, case: Case) -> str:
    if not side.meta:
        return f"{side.folder / META} is missing or unreadable"
    try:
        tensors = load_tensors(side.outputs)
    except CheckpointError as error:
        return str(error)
    for spec in case.output_specs():
        if spec.name not in tensors:
            return f"{side.outputs} lacks tensor {spec.name!r} (has {sorted(tensors)})"
        array, dtype = tensors[spec.name], spec.dtype or case.dtype
        if tuple(array.shape) != spec.shape or array.dtype.name != dtype:
            return (f"{side.outputs}: tensor {spec.name!r} is {array.dtype.name}{list(array.shape)}, "
                    f"expected {dtype}{list(spec.shape)}")
    return ""


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM the whole group, give it a moment, then SIGKILL whatever of it is left."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: Path) -> str:
    try:
        text = path.read_bytes()[-STDERR_TAIL_CHARS:].decode("utf-8", "replace")
    except OSError:
        return ""
    return text


def _read_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / META).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
