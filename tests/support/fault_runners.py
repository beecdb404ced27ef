"""Named misbehaving runners (test doubles). Each is started through the harness's own ``--python RUNNER=PATH``
mechanism: ``interpreter(folder, behaviour)`` writes an executable that the harness runs as
``PATH -m harness.runners.<runner> --request REQUEST``; it runs ``python -m tests.support.fault_runners BEHAVIOUR ...``
instead, which does what its name says. Every process a double starts (itself, its children, a daemon) appends
its pid to the file named by ``FAULT_PIDS``, so a test can check that none is left.

Behaviours: good (valid outputs, the same bits on every side: a bitwise pass), one_bit (``good`` with one bit
of ``out`` flipped: a DIFF), crash, hang (and a child in its group), hang_spawner (a child in its group and one
in a session of its own, then hangs), daemon (starts a daemon in a new session, then succeeds), garbage
(outputs that are not safetensors), nan (NaN in ``out``), wrong_shape, wrong_dtype, missing_tensor,
extra_tensor, no_meta, no_outputs (exit 0, writes nothing), random (different bits every run),
unsupported (exit 3 with a reason), self_kill (SIGKILL itself), loud_crash (10 MB of stderr, then exit 1), oom
(torch's out-of-GPU-memory error as torch prints it, then exit 1);
for workers (``--worker``, harness.run.workers): crash_second and hang_second (``good``, but crash or hang in a
worker's second cell), per_process (bits that differ between processes but not between cells of one process).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

BEHAVIOURS = ("good", "one_bit", "crash", "hang", "hang_spawner", "daemon", "garbage", "nan", "wrong_shape",
              "wrong_dtype", "missing_tensor", "extra_tensor", "no_meta", "no_outputs", "random", "unsupported",
              "self_kill", "loud_crash", "oom", "crash_second", "hang_second", "per_process")
REPO = Path(__file__).resolve().parents[2]
# torch 2.x's caching allocator's message (c10/cuda/CUDACachingAllocator.cpp), at the sizes of
# kimi_k2_2layer_train_full's AdamW step on an H100 (docs/gpu-and-tp.md)
TORCH_OOM = (
    "Traceback (most recent call last):\n  File \"torch/optim/adamw.py\", line 473, in _multi_tensor_adamw\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.97 GiB memory in use. Of the "
    "allocated memory 76.40 GiB is allocated by PyTorch, and 1.05 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def interpreter(folder: Path, behaviour: str) -> str:
    """An executable standing in for a runner's interpreter that behaves as `behaviour`."""
    assert behaviour in BEHAVIOURS, behaviour
    path = Path(folder) / f"fake_{behaviour}_python"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -m tests.support.fault_runners {behaviour} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def note_pid(pid: int | None = None) -> None:
    target = os.environ.get("FAULT_PIDS")
    if target:
        with open(target, "a") as pids:
            pids.write(f"{pid or os.getpid()}\n")


def _outputs(request: dict, seed: int = 0) -> dict:
    import ml_dtypes  # noqa: F401
    import numpy as np

    from harness.bits import format_of
    from harness.case.ops import OPS

    specs = OPS[request["op"]].outputs(request["shapes"], request["tokens"], request["config"])
    tensors = {}
    for spec in specs:
        dtype = spec.dtype or request["dtype"]
        rng = np.random.default_rng([zlib.crc32(spec.name.encode()), seed])
        if dtype.startswith("int"):
            tensors[spec.name] = rng.integers(0, 4, spec.shape).astype(dtype)
        else:
            tensors[spec.name] = rng.standard_normal(spec.shape).astype(format_of(dtype).float_dtype)
    return tensors


def _save(tensors: dict, out: Path, meta: dict | None = None) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(out / "outputs.safetensors"))
    if meta is not None:
        (out / "meta.json").write_text(json.dumps(meta))


def _spawn_sleeper(new_session: bool) -> None:
    child = subprocess.Popen(["sleep", "300"], start_new_session=new_session, stdin=subprocess.DEVNULL)
    note_pid(child.pid)


def _start_daemon() -> None:
    """The classic double fork: the daemon ends in a session of its own, its parent gone."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            note_pid()
            os.closerange(3, 256)
            time.sleep(300)
            os._exit(0)
        os._exit(0)
    os.wait()


def main(behaviour: str, argv: list[str]) -> None:
    """One request (``--request PATH``), or a worker's many (``--worker --reply-fd FD``, harness.run.workers)."""
    note_pid()
    if "--worker" in argv:
        from harness.run.protocol import serve_cells

        reply_fd = int(argv[argv.index("--reply-fd") + 1])
        sys.exit(serve_cells(lambda path, cell: cell_of(behaviour, path, cell), reply_fd))
    cell_of(behaviour, Path(argv[argv.index("--request") + 1]))


def cell_of(behaviour: str, request_path: Path, cell: int = 1) -> int:
    """Do what `behaviour` says for one request (`cell`: its number in a worker; 1 in a process of its own)."""
    request = json.loads(request_path.read_text())
    out = Path(request["output_dir"])
    meta = {"runner": f"double:{behaviour}", "implementation": f"test double {behaviour!r} (not a framework)"}
    print(f"test double {behaviour} starts for {request['case']}", file=sys.stderr, flush=True)
    tensors = _outputs(request)
    if behaviour in ("good", "extra_tensor"):
        if behaviour == "extra_tensor":
            tensors["surplus"] = tensors["out"].copy()
        _save(tensors, out, meta)
    elif behaviour == "one_bit":
        flat = tensors["out"].reshape(-1).view(f"u{tensors['out'].itemsize}")
        flat[0] ^= 1
        _save(tensors, out, meta)
    elif behaviour == "crash":
        print("Traceback (most recent call last):\nRuntimeError: simulated crash in a test double", file=sys.stderr)
        sys.exit(7)
    elif behaviour == "oom":
        print(TORCH_OOM, file=sys.stderr)
        sys.exit(1)
    elif behaviour == "loud_crash":
        sys.stderr.write("x" * 10_000_000 + "\nsimulated loud crash\n")
        sys.exit(1)
    elif behaviour in ("hang", "hang_spawner"):
        _spawn_sleeper(new_session=False)
        if behaviour == "hang_spawner":
            _spawn_sleeper(new_session=True)
        print("test double hangs", file=sys.stderr, flush=True)
        time.sleep(300)
    elif behaviour == "daemon":
        _start_daemon()
        _save(tensors, out, meta)
    elif behaviour == "garbage":
        (out / "outputs.safetensors").write_bytes(os.urandom(300))
        (out / "meta.json").write_text(json.dumps(meta))
    elif behaviour == "nan":
        tensors["out"].reshape(-1)[0] = float("nan")
        _save(tensors, out, meta)
    elif behaviour == "wrong_shape":
        tensors["out"] = tensors["out"][:1]
        _save(tensors, out, meta)
    elif behaviour == "wrong_dtype":
        tensors["out"] = tensors["out"].astype("float64")
        _save(tensors, out, meta)
    elif behaviour == "missing_tensor":
        del tensors["grad.weight"]
        _save(tensors, out, meta)
    elif behaviour == "no_meta":
        _save(tensors, out)
    elif behaviour == "no_outputs":
        pass
    elif behaviour == "random":
        _save(_outputs(request, seed=int.from_bytes(os.urandom(4), "little")), out, meta)
    elif behaviour == "unsupported":
        (out / "meta.json").write_text(json.dumps({**meta, "unsupported": "test double: no kernel for this"}))
        sys.exit(3)
    elif behaviour == "self_kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif behaviour == "crash_second":
        if cell == 2:
            print("Traceback (most recent call last):\nRuntimeError: simulated crash in cell 2", file=sys.stderr)
            sys.exit(7)
        _save(tensors, out, meta)
    elif behaviour == "hang_second":
        if cell == 2:
            print("test double hangs in cell 2", file=sys.stderr, flush=True)
            time.sleep(300)
        _save(tensors, out, meta)
    elif behaviour == "per_process":
        _save(_outputs(request, seed=os.getpid()), out, meta)
    return 0


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
