"""Start runner subprocesses, watch them, and collect what they wrote.

Each runner runs in its own process group (so a timeout kills it and everything it started), with
its own interpreter (``--python NAME=PATH`` or ``HARNESS_PYTHON_<NAME>``, else the environment its family names for
its HF side (``harness.environments``), default: this one), and
the repository on ``PYTHONPATH`` so a user's own environment needs no install of the harness.
Both sides start at once and run concurrently. A side with tp > 1 runs under its framework's launcher
(``harness.run.launch``) and its rank files are gathered into the canonical ones (``harness.run.shards``); so does a
training side with train.dp > 1, whose ranks each check in their state after every step (``harness.run.steps``).
Inside ``workers.serving`` (a sweep, nightly, gate matrix or repeat) a one-rank side is the next cell of a worker
process that stays up across cells (``harness.run.workers``) instead of a process of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from harness import environments, paths, resources
from harness.case.batch import CACHE_OUTPUTS
from harness.case.checkpoints import CHECKPOINTS_DIR, Checkpoint, CheckpointError, tensor_layouts
from harness.case.registry import Case
from harness.case.specs import resolve_dtype
from harness.run import launch, placement, shards, steps, supervisor, workers
from harness.run.kernels import onednn_kernels
from harness.run.protocol import EXIT_UNSUPPORTED, META, OUTPUTS

REPO_ROOT = Path(__file__).resolve().parents[2]
TRUTH = "truth"  # the truth side's own name for an interpreter (--python truth=PATH)
ORACLE_RUNNER = "oracle"  # the op level's framework-free truth: no side runs it, so its own name picks its interpreter
HF_RUNNERS = ("hf_model",)  # the runners whose interpreter a family's hf.toml environment picks
STDERR_TAIL_CHARS = 4000
# Intra-op threads of every runner unless the user sets OMP_NUM_THREADS / MKL_NUM_THREADS: oneDNN and MKL may split a
# reduction across threads, so the count is part of a result (harness.baselines.records records it). Fixed, so a
# night's bits do not move with `--workers` or the machine's core count (2 on this project's CI runners, whose two
# sides then fill both cores). Paddle uses 1 thread unless told.
RUNNER_THREADS = "2"
# How long an OpenMP thread waits for work before it yields its core: about 10 us (GNU, torch) and 1 ms (Intel, Paddle)
# instead of their defaults (300,000 spins; 200 ms). On a CPU both sides and the oracle share the cores, and one's
# spinning threads held up the other: a 20-step training compare took 70 s and 99 CPU s with the defaults, 57 s and
# 80 CPU s with these; every tensor's bits and ULPs the same. Scheduling only (not a baseline's runner field).
OPENMP_WAITING = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
# Settings of the real alignment runs; recorded by each runner in meta.json.
GPU_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "FLAGS_use_accuracy_compatible_kernel": "1",
           "NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NCCL_NVLS_ENABLE": "0",
           # the step digests' Triton kernel (harness.runners.torch.digest_triton) compiles once into the harness's
           # own folder, not the user's ~/.triton
           "TRITON_CACHE_DIR": str(CHECKPOINTS_DIR / ".triton")}


@dataclass
class SideResult:
    label: str  # "a", "b", "oracle"; a repeat adds its run number ("a.2")
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


def runner_python(runner: str, overrides: dict[str, str], environment: str | None = None) -> str:
    """The side's interpreter: the user's (``--python``, ``HARNESS_PYTHON_<NAME>``), else the named environment's
    (``harness.environments``: the family's HF side), else this one."""
    given = overrides.get(runner) or os.environ.get(f"HARNESS_PYTHON_{runner.upper()}")
    return given or (environments.python(environment) if environment else sys.executable)


def truth_python(runner: str, overrides: dict[str, str], environment: str | None = None) -> str:
    """The truth's interpreter: its own (``--python truth=PATH``, ``HARNESS_PYTHON_TRUTH``; the op level's oracle also
    ``--python oracle=PATH``, a runner no side runs), never a side's: a model's or a training run's truth runs
    hf_model's code, and under hf_model's interpreter it inherited whatever that environment does wrong (issue 40).
    A family whose HF class needs a named environment gets that environment's interpreter, as its HF side does."""
    own = overrides.get(TRUTH) or os.environ.get(f"HARNESS_PYTHON_{TRUTH.upper()}")
    if own or runner == ORACLE_RUNNER:
        return own or runner_python(runner, overrides)
    return environments.python(environment) if environment else sys.executable


def side_python(case: Case, side: SideSpec, overrides: dict[str, str]) -> tuple[str, str]:
    """(the side's interpreter, why it cannot run: "" when it can). A model case's HF side and its truth run in the
    environment the family's hf.toml names, if any; where that environment is not created, the side is UNSUPPORTED
    naming the package it holds (a user's own --python is taken as it is)."""
    environment = side.environment or (environments.of_family(case.model.record) if case.model is not None and (
        side.truth or side.runner in HF_RUNNERS) else None)
    python = (truth_python if side.truth else runner_python)(side.runner, overrides, environment)
    named = environment is not None and python == environments.python(environment)
    return python, environments.missing(environment) if named else ""


def runner_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", RUNNER_THREADS)
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    for key, value in OPENMP_WAITING.items():
        env.setdefault(key, value)
    env["PYTHONUNBUFFERED"] = "1"
    if device == "gpu":
        for key, value in GPU_ENV.items():
            env.setdefault(key, value)
    else:
        env.setdefault("ONEDNN_VERBOSE", "1")  # names the CPU kernels in the report (harness.run.kernels)
    env.update(placement.runner_env_overrides())  # a concurrent cell's own GPUs
    return env


class SideSpec(NamedTuple):
    """One runner process (or launch of TP ranks) to start: what it is called, what it runs and reads."""

    label: str  # "a", "b", "oracle", "a.2" (second run of a)...
    runner: str
    inputs: tuple[Path, ...]  # the checkpoint files it reads (weights, inputs: harness.case.checkpoints)
    tp: int
    folder: str  # its folder under the run directory
    dtype: str | None = None  # run in another dtype than the case's (the float64 truth of a model case)
    config: dict | None = None  # knobs set over the case's for this side only (comparing Paddle levels; a training
    # run's flip or re-feed)
    dp: int = 1  # data-parallel ranks: the side runs on tp x dp processes
    per_step: bool = False  # it writes one file per training step (harness.run.steps), checked rank against rank
    truth: bool = False  # the truth side: its own interpreter (truth_python), never a side's
    tokens: int | None = None  # run at another token count than the case's (a batch around its rows: --versus batch)
    environment: str | None = None  # its HF side in this environment, not the family's (--versus environment)


def pair_sides(case: Case, checkpoint: Checkpoint, tps: tuple[int, int] | None = None,
               impls: tuple[str, str] | None = None) -> list[SideSpec]:
    """The case's two sides, a and b, each at the case's TP size or, comparing TP sizes, at its own; comparing Paddle
    implementation levels, each with its own ``config.paddle_impl``."""
    return [SideSpec(label, runner, checkpoint.files_for(label), tp,
                     f"{label}-{runner}" + (f"-tp{tp}" if tps else "") + (f"-{impl}" if impls else ""),
                     config={"paddle_impl": impl} if impls else None)
            for label, runner, tp, impl in zip("ab", case.runners, tps or (case.tp, case.tp), impls or (None, None),
                                               strict=True)]


def run_sides(case: Case, sides: list[SideSpec], device: str, run_dir: Path,
              pythons: dict[str, str], timeout: float) -> list[SideResult]:
    """Run the sides concurrently on a CPU, one after another on a GPU (each side gets the whole device's memory: a
    model's float64 truth beside two bf16 sides does not fit one GPU); never raises for a runner's failure. The
    timeout covers the whole group (on a GPU: each side)."""
    if device == "gpu" and len(sides) > 1:
        return [result for side in sides for result in run_sides(case, [side], device, run_dir, pythons, timeout)]
    if device == "gpu" and case.gpu_memory_gib and (short := too_little_memory(case.gpu_memory_gib)):
        return [SideResult(side.label, side.runner, "error", run_dir / side.folder, "", reason=short)
                for side in sides]
    with supervisor.watch():  # whatever the runners started and left behind is killed and reaped afterwards
        started = []
        for side in sides:
            folder = paths.child(run_dir, side.folder, "runner folder")
            side_case = replace(case, dtype=side.dtype) if side.dtype else case  # the float64 truth of a model
            side_case = replace(side_case, config={**case.config, **side.config}) if side.config else side_case
            side_case = side_case.with_tokens(side.tokens) if side.tokens else side_case
            with resources.boundary("runner folder", folder):
                folder.mkdir(parents=True)
                request = _request(side_case, side.inputs, device, folder, side.tp)
                (folder / "request.json").write_text(json.dumps(request, indent=2))
            label, runner, tp, dp = side.label, side.runner, side.tp, side.dp
            python, unmet = side_python(case, side, pythons)
            if unmet:  # not started: its environment is not there
                started.append(SideResult(label, runner, "unsupported", folder, python, reason=unmet))
                continue
            started.append((label, runner, folder, python, tp * dp, _start(runner, python, folder, device, tp, dp),
                            side_case, side.per_step))
        deadline = time.monotonic() + timeout
        # One waiter per side, all at once: each side's wall time ends when it does, and each launcher's
        # descendants are watched from the start (a rank re-parented while we waited on another side is missed).
        with ThreadPoolExecutor(max_workers=max(1, len(started))) as waiters:
            try:
                waiting = [s if isinstance(s, SideResult) else waiters.submit(_finish, *s[:6], deadline, timeout,
                                                                                   *s[6:]) for s in started]
                # Woken twice a second: a Ctrl-C that the kernel gave to another thread of this process is then
                # raised here at once. Blocked on the results alone, this thread raised it only when the sides ended
                # (a library caller's Ctrl-C waited out a 120 s timeout: tests/test_faults.py, once in a full run).
                while wait([w for w in waiting if not isinstance(w, SideResult)], timeout=0.5).not_done:
                    pass
                return [w if isinstance(w, SideResult) else w.result() for w in waiting]
            except BaseException:  # Ctrl-C, even without the CLI's handlers: stop the runners, do not wait on them
                supervisor.stop_all()
                raise


def run_side(label: str, runner: str, case: Case, inputs: tuple[Path, ...], device: str, folder: Path,
             pythons: dict[str, str], timeout: float) -> SideResult:
    """Run one runner alone on inputs files (re-feed runs one op of a block on one side)."""
    return run_sides(case, [SideSpec(label, runner, inputs, case.tp, folder.name)], device, folder.parent,
                     pythons, timeout)[0]


def _request(case: Case, checkpoint: tuple[Path, ...], device: str, folder: Path, tp: int) -> dict:
    """The runner's request (docs/model-contract.md): ``checkpoint`` lists the files that together hold every input
    tensor, each name in exactly one of them (``harness.run.protocol.read_checkpoint``)."""
    config = case.config if tp > 1 or "sequence_parallel" not in case.config else {**case.config,
                                                                                    "sequence_parallel": False}
    return {"schema": 1, "case": case.name, "op": case.op, "dtype": case.dtype, "device": device, "tp": tp,
            "tokens": case.tokens, "shapes": case.shapes, "config": config, "seed": case.seed,
            "checkpoint": [str(path.resolve()) for path in checkpoint], "output_dir": str(folder.resolve())}


def _start(runner: str, python: str, folder: Path, device: str, tp: int, dp: int = 1):
    command, launched = launch.command(runner, python, folder / "request.json", tp, folder, dp)
    pool = workers.active() if tp * dp == 1 else None
    if pool is not None:
        return _start_in_worker(pool, runner, python, folder, device, command[:3])
    with resources.boundary("runner folder", folder):
        (folder / "command.txt").write_text(" ".join(command) + "\n")
        out, err = open(folder / "stdout.log", "wb"), open(folder / "stderr.log", "wb")
    with out, err:
        try:
            with supervisor.starting():
                process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                           env=runner_env(device), start_new_session=True)
                supervisor.register(process)
        except OSError as error:  # e.g. the configured interpreter does not exist
            err.write(f"cannot start {command[0]}: {error}\n".encode())
            process = None
    return process, time.monotonic(), launched


def _start_in_worker(pool: workers.Pool, runner: str, python: str, folder: Path, device: str, command: list[str]):
    """The side as the next cell of a worker for (runner, interpreter, device, runner environment)."""
    env = runner_env(device)
    key = (runner, python, device, tuple(sorted(placement.runner_env_overrides().items())))
    start = time.monotonic()
    try:
        worker = pool.acquire(key, runner, command, env, REPO_ROOT)
    except OSError as error:  # e.g. the configured interpreter does not exist
        with resources.boundary("runner folder", folder):
            (folder / "stderr.log").write_text(f"cannot start {command[0]}: {error}\n")
        return None, start, {"launcher": "worker", "tp": 1}
    cell = workers.Cell(worker, folder / "request.json", pool)
    with resources.boundary("runner folder", folder):
        (folder / "command.txt").write_text(f"cell {cell.ran_in['cell']} of worker {worker.process.pid}: "
                                            f"{' '.join(worker.process.args)}\n")
    return cell, start, {"launcher": "worker", "tp": 1}


def _finish(label, runner, folder, python, ranks, launched, deadline, timeout, case, per_step) -> SideResult:
    process, start, launch_info = launched
    side = SideResult(label, runner, "error", folder, python)
    if process is None:
        side.reason = f"could not start interpreter {python!r}"
    elif isinstance(process, workers.Cell):
        side.returncode = process.wait(max(0.0, deadline - time.monotonic()))
        if side.returncode is None:
            side.reason = f"timed out after {timeout:g} s; its worker's process group was killed"
    else:
        side.returncode, seen = launch.wait(process, max(0.0, deadline - time.monotonic()))
        if side.returncode is None:
            launch.kill_tree(process)
            side.returncode = process.returncode
            side.reason = f"timed out after {timeout:g} s; its process group was killed"
            side.reason += f", with all {ranks} ranks" if ranks > 1 else ""
        launch_info["leftovers_killed"] = launch.kill_leftovers(seen)
        supervisor.unregister(process)
    side.wall_seconds = time.monotonic() - start
    if per_step and steps.paced(folder):  # a harness following its steps waits for no more (harness.run.follow)
        steps.mark(folder, steps.ENDED)
    side.stderr_tail = _tail(folder / "stderr.log")
    if isinstance(process, workers.Cell) and side.returncode not in (0, EXIT_UNSUPPORTED):
        side.stderr_tail += f"\n--- worker {process.worker.process.pid} log (tail) ---\n{process.log_tail()}\n"
    side.meta = _read_meta(folder) if ranks == 1 else shards.merge_metas(folder, ranks, launch_info)
    if side.meta:
        side.meta.setdefault("process", process.ran_in if isinstance(process, workers.Cell) else
                             {"mode": "fresh process", "pid": getattr(process, "pid", None)})
    if ranks > 1:
        side.stderr_tail += "".join(f"\n--- rank {rank} stderr (tail) ---\n{text}\n"
                                    for rank, text in launch.rank_tails(folder, ranks).items())
    if side.meta:
        side.meta["onednn_kernels"] = onednn_kernels(folder / "stdout.log")
    if side.reason:
        return side
    if "unsupported" in side.meta and (side.returncode == EXIT_UNSUPPORTED or ranks > 1):
        side.status, side.reason = "unsupported", side.meta["unsupported"]
    elif side.returncode != 0 or "unsupported_on_some_ranks" in side.meta:
        blamed = launch.failed_rank(side.stderr_tail) if ranks > 1 else ""
        side.reason = "; ".join(filter(None, [out_of_memory(side.stderr_tail) if side.returncode else "",
                                              disk_full(side.stderr_tail) if side.returncode else "",
                                              f"exited with code {side.returncode}", blamed,
                                              side.meta.get("unsupported_on_some_ranks")]))
    else:
        if per_step:  # its step files first, then every rank's state against rank 0's
            problem = _validate_steps(side, case) or (_gather(side, case, ranks, per_step) if ranks > 1 else "")
        else:
            problem = (_gather(side, case, ranks, per_step) if ranks > 1 else "") or _validate_outputs(side, case)
        side.status, side.reason = ("error", f"bad output: {problem}") if problem else ("ok", "")
    return side


def too_little_memory(needed_gib: float) -> str:
    """Why a side that needs `needed_gib` of GPU memory (the case's ``gpu_memory_gib``) cannot run on the GPUs this
    process may use, or '' (also when nvidia-smi cannot say: the runner's own out-of-memory error then names it)."""
    visible = placement.visible_gpus({**os.environ, **placement.runner_env_overrides()})
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total,name", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in listed.splitlines():
        index, total, name = (part.strip() for part in line.split(",", 2))
        if index in visible and total.isdigit() and int(total) / 1024 < needed_gib:
            return (f"needs {needed_gib:g} GiB of GPU memory (case field gpu_memory_gib), GPU {index} ({name}) has "
                    f"{int(total) / 1024:.1f} GiB: not started")
    return ""


# What each framework prints when an allocation fails: torch's caching allocator (torch.OutOfMemoryError), Paddle's
# (ResourceExhaustedError), Python's own on the host
TORCH_OOM = re.compile(r"CUDA out of memory\. Tried to allocate ([\d.]+ \w+)\. GPU (\d+) has a total capacity of "
                       r"([\d.]+ \w+) of which ([\d.]+ \w+) is free")
PADDLE_OOM = re.compile(r"Cannot allocate ([\d.]+\s*\w+) memory on GPU (\d+), ([\d.]+\s*\w+) memory has been "
                        r"allocated and available memory is only ([\d.]+\s*\w+)")
GPU_OOM_WORDS = ("torch.OutOfMemoryError", "CUDA out of memory", "ResourceExhaustedError", "Out of memory error on GPU")


def out_of_memory(stderr_tail: str) -> str:
    """What a runner that died of an allocation says about it, named (the sizes from its own message), or ''."""
    if match := TORCH_OOM.search(stderr_tail):
        wanted, gpu, total, free = match.groups()
        return (f"ran out of GPU memory: tried to allocate {wanted}, device has {total} total ({free} free, "
                f"GPU {gpu})")
    if match := PADDLE_OOM.search(stderr_tail):
        wanted, gpu, held, free = match.groups()
        return (f"ran out of GPU memory: tried to allocate {wanted}, {held} allocated already ({free} free, "
                f"GPU {gpu})")
    if any(word in stderr_tail for word in GPU_OOM_WORDS):
        return "ran out of GPU memory"
    if re.search(r"^MemoryError\b", stderr_tail, re.MULTILINE):
        return "ran out of host memory (MemoryError)"
    return ""


# What Python (OSError), C stdio (perror, strerror) and the frameworks print when a write meets a full disk or quota
DISK_FULL = re.compile(r"(?:\[Errno (?:28|122)\] )?(No space left on device|Disk quota exceeded)(?:: '([^']*)')?")


def disk_full(stderr_tail: str) -> str:
    """A runner that died writing to a full disk, named (with the file it was writing when its error says), or ''."""
    match = DISK_FULL.search(stderr_tail)
    if not match:
        return ""
    reason, path = match.groups()
    return f"disk full: {reason.lower()}" + (f" writing {path}" if path else "")


def _gather(side: SideResult, case: Case, ranks: int, per_step: bool) -> str:
    """Put the rank files together (a training run: check every rank's step state against rank 0's); a replicated
    tensor that differs between ranks is recorded in meta.json."""
    if per_step:
        checks = steps.ranks_agree(side.folder, case, ranks)
        if "problem" in checks:
            return checks["problem"]
        side.meta["ranks_agree"] = checks
        (side.folder / META).write_text(json.dumps(side.meta, indent=2, sort_keys=True, default=str))
        return ""
    try:
        checks = shards.gather(side.folder, ranks, [s.name for s in case.output_specs()],
                               case.op_spec.partition(case.config))
    except shards.GatherError as error:
        return str(error)
    side.meta["gather"] = checks
    (side.folder / META).write_text(json.dumps(side.meta, indent=2, sort_keys=True, default=str))
    return ""


def _validate_steps(side: SideResult, case: Case) -> str:
    """A training side's step files (harness.run.steps), checked before its ranks are."""
    if not side.meta:
        return f"{side.folder / META} is missing or unreadable"
    return steps.validate(side.folder, case)


def _validate_outputs(side: SideResult, case: Case) -> str:
    if not side.meta:
        return f"{side.folder / META} is missing or unreadable"
    try:
        tensors = tensor_layouts(side.outputs)
    except CheckpointError as error:
        return str(error)
    specs = case.output_specs()
    if case.config.get("kv_cache_chunk"):  # --versus cache: a forward through the KV cache, its logits and loss only
        specs = [spec for spec in specs if spec.name in CACHE_OUTPUTS]
    if side.runner == "oracle" and side.label == "oracle":  # the third side: its formula may cover only some outputs
        specs = [spec for spec in specs if spec.name in tensors]
        if not specs:
            return f"{side.outputs} holds none of the op's outputs (has {sorted(tensors)})"
    for spec in specs:
        if spec.name not in tensors:
            if spec.optional:
                continue
            return f"{side.outputs} lacks tensor {spec.name!r} (has {len(tensors)} tensors)"
        (got_dtype, got_shape), dtype = tensors[spec.name], resolve_dtype(spec.dtype, case.dtype)
        shape_ok = len(got_shape) == len(spec.shape) and all(
            want in (-1, got) for want, got in zip(spec.shape, got_shape, strict=True))
        if not shape_ok or got_dtype != dtype:
            return f"{side.outputs}: tensor {spec.name!r} is {got_dtype}{got_shape}, expected {dtype}{list(spec.shape)}"
    return ""


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
