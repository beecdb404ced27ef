"""The runner side of the request/outputs contract: framework-free, standard library only.

Under a launcher (torchrun, paddle.distributed.launch) every rank writes its own shard and meta,
named with its rank (``outputs.rank1.safetensors``, ``meta.rank1.json``); the harness gathers them.
A runner started with ``--worker`` serves many requests in one process (``serve_cells``; ``harness.run.workers``
is the harness's end); each request's files are the same as a process of its own would write.

Exit codes: 0 outputs written; 3 the framework lacks a kernel or package for this request
(``meta.json`` says which): a package that is not installed (``import_failure``) or a kernel the framework says is
not registered, nothing else; anything else is a crash (a broken install included), which the harness reports as
ERROR with the traceback's tail.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from harness import resources
from harness.run.cell_state import environment_restored, patches_undone

EXIT_UNSUPPORTED = 3
OUTPUTS = "outputs.safetensors"
META = "meta.json"
ENV_PREFIXES = ("OMP_", "GOMP_", "MKL_", "KMP_", "ONEDNN_", "DNNL_", "OPENBLAS_", "CUBLAS_", "CUDA_", "NCCL_",
                "NVTE_", "FLAGS_", "TORCH", "PYTORCH_", "NVIDIA_TF32", "HARNESS_")


def rank_and_world() -> tuple[int, int]:
    """This process's tensor-parallel rank and world size, from whichever launcher started it (1 process: 0, 1)."""
    for rank_key, world_key in (("RANK", "WORLD_SIZE"), ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM")):
        if rank_key in os.environ and world_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[world_key])
    return 0, 1


def rank_file_name(name: str, rank: int, world: int) -> str:
    """``outputs.safetensors`` -> ``outputs.rank1.safetensors`` when there are several ranks."""
    if world == 1:
        return name
    stem, dot, suffix = name.partition(".")
    return f"{stem}.rank{rank}{dot}{suffix}"


def shard_index(shape, dim: int | None, rank: int, world: int) -> tuple[slice, ...]:
    """The index of this rank's equal shard along `dim` (all of it when `dim` is None); works on torch and numpy."""
    index = [slice(None)] * len(shape)
    if dim is not None and world > 1:
        size = shape[dim] // world
        index[dim] = slice(rank * size, (rank + 1) * size)
    return tuple(index)


class Unsupported(Exception):
    """The framework cannot run this request here (missing package or kernel); the message says which."""


class BrokenInstall(Exception):
    """A package that is installed but does not import (a dependency missing inside it, an error in its code): the
    runner's environment is broken. Never UNSUPPORTED: the cell ends as a crash (ERROR) with the import's traceback."""


def import_failure(package: str, error: BaseException) -> Exception:
    """What a failed ``import package`` means: Unsupported when `package` itself is not installed (Python's
    ModuleNotFoundError names it, or a package above it), else BrokenInstall (raise it ``from error``)."""
    missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if missing and (package == missing or package.startswith(missing + ".")):
        return Unsupported(f"{package} is not installed for {sys.executable} ({error})")
    return BrokenInstall(f"{package} is installed for {sys.executable} but does not import: "
                         f"{type(error).__name__}: {error}")


def import_answer(package: str, error: BaseException) -> dict:
    """A probe's answer for a framework that does not import: not installed, or installed and broken (the doctor
    says which)."""
    failure = import_failure(package, error)
    return {"importable": False, "broken": isinstance(failure, BrokenInstall), "reason": str(failure)}


def read_checkpoint(files: list[str], load: Callable[[str], dict]) -> dict:
    """Every input tensor of a request: ``request["checkpoint"]`` lists the files that together hold them (the case's
    weights, then what depends on the token count; docs/model-contract.md), each name in exactly one. `load(path)`
    reads one file, in the runner's own framework; this is the one place each runner room reads a checkpoint."""
    if isinstance(files, str) or not all(isinstance(path, str) for path in files):
        raise ValueError(f"request field 'checkpoint' must be a list of safetensors files (got {files!r:.200})")
    tensors: dict = {}
    for path in files:
        for name, tensor in load(path).items():
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} is also in an earlier checkpoint file of {files}")
            tensors[name] = tensor
    return tensors


class Phases:
    """Wall time per phase (import, setup, forward, backward, write), in seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 6)


def serve(runner: str, run: Callable[[dict, Phases], dict], probe: Callable[[str], dict] | None = None,
          reset: Callable[[], None] | None = None,
          cell_state: Callable[[], AbstractContextManager] | None = None) -> None:
    """Run the request named on the command line (``--request``), or serve many (``--worker``), then exit.

    `run(request, phases)` writes the outputs file and returns the framework's provenance; `reset()` (optional)
    clears what a cell may leave in the framework (a process group, cached device memory) before the next one;
    `cell_state()` (optional) is entered around each cell and puts back every process-wide setting the runner's
    framework room may change (``harness.run.cell_state``); ``os.environ`` is put back for every runner.
    With ``--probe`` the runner computes nothing: it prints one JSON object (``probe_answer``) saying what this
    interpreter has and which implementation each op would get on ``--device`` (the doctor's question), and exits 0.
    """
    parser = argparse.ArgumentParser(prog=f"python -m harness.runners.{runner}")
    parser.add_argument("--request", type=Path)
    parser.add_argument("--worker", action="store_true",
                        help="serve cells: request paths on stdin (harness.run.workers)")
    parser.add_argument("--reply-fd", type=int, help="with --worker: the pipe each cell's exit code is written to")
    parser.add_argument("--probe", action="store_true", help="answer what would run here as JSON; compute nothing")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="the device --probe asks about")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe_answer(runner, args.device, probe), default=str))
        sys.exit(0)
    if args.worker:
        if args.reply_fd is None:
            parser.error("--worker needs --reply-fd FD")
        code = serve_cells(lambda path, cell: run_cell(runner, run, path, cell, reset, cell_state), args.reply_fd)
        _flush_all()
        os._exit(code)  # every cell's files are written and closed: skip the frameworks' slow interpreter teardown
    if args.request is None:
        parser.error("--request FILE is required (or --worker, or --probe)")
    code = run_cell(runner, run, args.request, cell_state=cell_state)  # an exception: Python's own exit 1
    _flush_all()
    # Outputs and meta.json are written and closed: skip the frameworks' interpreter teardown, as a worker does. A
    # Paddle TP rank 0 (host of the TCP store) sometimes aborted in that teardown after writing everything, even
    # after a barrier (SIGABRT, nothing on stderr): a false ERROR (make test, 2026-12-01, kimi_shared_fc2_fp32_tp2).
    os._exit(code)


def run_cell(runner: str, run: Callable[[dict, Phases], dict], request_path: Path, cell: int | None = None,
             reset: Callable[[], None] | None = None,
             cell_state: Callable[[], AbstractContextManager] | None = None) -> int:
    """One request: outputs (by `run`) and meta.json written; the contract's exit code. `cell`: its number in a
    worker (None: a process of its own), recorded in meta.json. What the cell changes in the process (the
    environment, and what `cell_state` covers) is put back when it ends, however it ends."""
    request = json.loads(Path(request_path).read_text())
    output_dir = Path(request["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    rank, world = rank_and_world()
    process = ({"mode": "fresh process", "pid": os.getpid()} if cell is None else
               {"mode": "shared worker", "pid": os.getpid(), "cell": cell})
    meta = {"runner": runner, "case": request["case"], "op": request["op"], "device": request["device"],
            "host": host_provenance(), "env": env_flags(), "python": sys.version.split()[0],
            "executable": sys.executable, "rank": rank, "world_size": world, "process": process}
    code = 0
    try:
        with environment_restored(), patches_undone(), (cell_state or nullcontext)():
            meta.update(run(request, phases))
    except Unsupported as reason:
        meta["unsupported"] = str(reason)
        code = EXIT_UNSUPPORTED
    finally:
        if reset is not None:
            reset()
    meta["phases"] = phases.seconds
    path = output_dir / rank_file_name(META, rank, world)
    path.with_suffix(".tmp").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    os.replace(path.with_suffix(".tmp"), path)  # whole or absent: a launcher may kill this rank at any moment after
    if code == EXIT_UNSUPPORTED and world > 1:
        await_ranks(output_dir, world, RANKS_WAIT_SECONDS)
    return code


RANKS_WAIT_SECONDS = 60.0


def await_ranks(output_dir: Path, world: int, seconds: float) -> None:
    """An UNSUPPORTED rank waits (at most `seconds`) for every rank's meta.json before it exits: a launcher stops every
    rank once one ends nonzero, and a side is UNSUPPORTED only when every rank says so (harness.run.shards
    .merge_metas), so a slower rank on its way to saying the same must get there (measured: Paddle's launcher killed
    rank 1 of PaddleFormers' expert parallel before it wrote its meta, once in two runs on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all((output_dir / rank_file_name(META, r, world)).exists()
                                                  for r in range(world)):
        time.sleep(0.1)


def serve_cells(cell: Callable[[Path, int], int], reply_fd: int) -> int:
    """A worker's loop: one request path per line on stdin; each cell's stdout and stderr go to ``stdout.log`` and
    ``stderr.log`` in its request's output folder (as a process of its own would write them), and its exit code
    to `reply_fd`. A cell that ends in anything but 0 or EXIT_UNSUPPORTED (an exception, ``sys.exit``) ends the
    worker too, since what it left behind is unknown; the harness starts a new one for the next cell."""
    replies = os.fdopen(reply_fd, "w", buffering=1)
    number = 0
    for line in sys.stdin:
        request_path = Path(line.strip())
        number += 1
        folder = Path(json.loads(request_path.read_text())["output_dir"])
        with _cell_output(folder):
            try:
                code = cell(request_path, number)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except Exception:  # noqa: BLE001 - reported as the cell's crash, as a process of its own would
                traceback.print_exc()
                code = 1
        replies.write(f"{code}\n")
        if code not in (0, EXIT_UNSUPPORTED):
            return code
        resources.give_back_freed_memory()  # after the reply (0.1 s, its gc): an idle worker holds what it keeps
    return 0


@contextmanager
def _cell_output(folder: Path):
    """Point file descriptors 1 and 2 (Python's and C's stdio: oneDNN's verbose lines) at the cell's own logs."""
    _flush_all()
    saved = os.dup(1), os.dup(2)
    with open(folder / "stdout.log", "ab") as out, open(folder / "stderr.log", "ab") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        yield
    finally:
        _flush_all()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _flush_all() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)  # C stdio buffers (a library's printf) belong to the cell that wrote them
    except (OSError, AttributeError):
        pass


def probe_answer(runner: str, device: str, probe: Callable[[str], dict] | None) -> dict:
    """The probe's answer: the interpreter and host, plus what the runner's own `probe(device)` says."""
    answer = {"runner": runner, "device": device, "python": sys.version.split()[0], "executable": sys.executable,
              "host": host_provenance(), "env": env_flags()}
    if probe is None:
        answer["note"] = "this runner answers no more than its interpreter and host"
        return answer
    try:
        answer.update(probe(device))
    except Exception as error:  # noqa: BLE001 - a probe that fails is an answer too
        answer["probe_error"] = f"{type(error).__name__}: {error}"
    return answer


def op_table(table: dict, runner: str) -> dict:
    """Per op of the catalogue: the function of a runner's ``IMPLEMENTATIONS`` table that would run, or why none."""
    from harness.case.ops import OPS

    return {name: {"would_run": f"{table[op].__module__}.{table[op].__name__}"} if op in table else
            {"would_run": None, "reason": f"the {runner} runner has no implementation of op {name!r}"}
            for name, op in OPS.items()}


def model_op_table(runner: str, would_run: dict) -> dict:
    """A whole-model runner's answer per op (``op_table``'s form): `would_run` maps each op it runs to what would
    run (a string, or {dtype: {"would_run" | "reason"}} where it depends on the dtype)."""
    from harness.case.ops import OPS

    return {name: (would_run[name] if isinstance(would_run[name], dict) else {"would_run": would_run[name]})
            if name in would_run else {"would_run": None, "reason": f"the {runner} runner runs whole models only"}
            for name in OPS}


def host_provenance() -> dict:
    return {"machine": platform.machine(), "system": platform.platform(), "cpu": cpu_model(),
            "cpu_isa": cpu_isa_flags(), "logical_cpus": os.cpu_count()}


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_isa_flags() -> list[str]:
    """The vector-ISA flags that decide which GEMM kernels a CPU framework may pick."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return []


def env_flags() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


@functools.cache  # read once per process: /proc/cpuinfo on a many-core host takes milliseconds, every cell asks
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
