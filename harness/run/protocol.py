"""The runner side of the request/outputs contract: framework-free, standard library only.

Under a launcher (torchrun, paddle.distributed.launch) every rank writes its own shard and meta,
named with its rank (``outputs.rank1.safetensors``, ``meta.rank1.json``); the harness gathers them.

Exit codes: 0 outputs written; 3 the framework lacks a kernel or package for this request
(``meta.json`` says which); anything else is a crash, which the harness reports as ERROR.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

EXIT_UNSUPPORTED = 3
OUTPUTS = "outputs.safetensors"
META = "meta.json"
ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "ONEDNN_", "DNNL_", "OPENBLAS_", "CUBLAS_", "CUDA_", "NCCL_",
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


def serve(runner: str, run: Callable[[dict, Phases], dict], probe: Callable[[str], dict] | None = None) -> None:
    """Read the request named on the command line, call `run`, write meta.json, exit with the contract's code.

    `run(request, phases)` writes the outputs file and returns the framework's provenance. With ``--probe`` the
    runner computes nothing: it prints one JSON object (``probe_answer``) saying what this interpreter has and which
    implementation each op would get on ``--device`` (the doctor's question), and exits 0.
    """
    parser = argparse.ArgumentParser(prog=f"python -m harness.runners.{runner}")
    parser.add_argument("--request", type=Path)
    parser.add_argument("--probe", action="store_true", help="answer what would run here as JSON; compute nothing")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="the device --probe asks about")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe_answer(runner, args.device, probe), default=str))
        sys.exit(0)
    if args.request is None:
        parser.error("--request FILE is required (or --probe)")
    request = json.loads(args.request.read_text())
    output_dir = Path(request["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    rank, world = rank_and_world()
    meta = {"runner": runner, "case": request["case"], "op": request["op"], "device": request["device"],
            "host": host_provenance(), "env": env_flags(), "python": sys.version.split()[0],
            "executable": sys.executable, "rank": rank, "world_size": world}
    code = 0
    try:
        meta.update(run(request, phases))
    except Unsupported as reason:
        meta["unsupported"] = str(reason)
        code = EXIT_UNSUPPORTED
    meta["phases"] = phases.seconds
    (output_dir / rank_file_name(META, rank, world)).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    sys.exit(code)


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


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
