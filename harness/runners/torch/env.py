"""Device setup, determinism settings, provenance, and the process-wide settings a cell gets back (``CELL_STATE``),
shared by the torch-based runners (imports torch only)."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import subprocess

import torch
from safetensors.torch import load_file

from harness.run.cell_state import all_restored, attribute_restored, restored
from harness.run.protocol import Unsupported, read_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
# torch refuses deterministic cuBLAS calls without a fixed workspace; the harness sets the same value (GPU_ENV).
CUBLAS_WORKSPACE = ":4096:8"


def select_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unsupported(f"torch {torch.__version__} sees no CUDA device (built with CUDA {torch.version.cuda})")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before the first cuBLAS handle exists
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def load_inputs(files: list[str], device: torch.device, take=None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (``request["checkpoint"]``: its files), or the part `take(name, tensor)` selects (a
    rank's shard), each in a fresh allocation on `device`.

    Tensors read from a safetensors file sit at offsets set by its header (measured: 48 mod 64 bytes), and MKL's
    fp32 GEMM result depends on operand alignment (measured: one token of the fc1 shape changed 3,656 of 4,096
    outputs when only the weight's address moved). A copy puts every operand on the allocator's 64-byte alignment,
    so no result depends on the file's header length.
    """
    take = take or (lambda name, tensor: tensor)
    return {name: take(name, tensor).contiguous().to(device=device, copy=True)
            for name, tensor in read_checkpoint(files, load_file).items()}


def sequences(tensor: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: a checkpoint's one sequence ``[s]`` as a batch of one; a batch (``--versus batch``) as it is."""
    return tensor if tensor.dim() == 2 else tensor.view(1, -1)


def apply_determinism(device: torch.device) -> dict:
    """The settings real alignment runs use: no TF32, no reduced-precision reductions, deterministic algorithms.

    torch >= 2.9 has a per-backend precision API and raises when the legacy ``allow_tf32`` flags are read after
    the new API was written, so the new API is used where it exists and only the new values are read back.
    """
    if _has_fp32_precision_api():
        for backend in (torch.backends.cuda.matmul, torch.backends.cudnn, torch.backends.cudnn.conv,
                        torch.backends.cudnn.rnn):
            backend.fp32_precision = "ieee"
        tf32 = {"cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
                "cudnn.conv.fp32_precision": torch.backends.cudnn.conv.fp32_precision}
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        tf32 = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    return {
        **tf32,
        "allow_bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "allow_fp16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def _has_fp32_precision_api() -> bool:
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018  (probing for the attribute)
    except AttributeError:
        return False
    return True


def _precision_flags():
    """The TF32 / reduced-precision switches ``apply_determinism`` writes, read the way it writes them."""
    matmul = torch.backends.cuda.matmul
    flags = {"allow_bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,
             "allow_fp16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction}
    if _has_fp32_precision_api():
        backends = {"cuda.matmul": matmul, "cudnn": torch.backends.cudnn, "cudnn.conv": torch.backends.cudnn.conv,
                    "cudnn.rnn": torch.backends.cudnn.rnn}
        return {**flags, **{name: backend.fp32_precision for name, backend in backends.items()}}
    return {**flags, "matmul.allow_tf32": matmul.allow_tf32, "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}


def _write_precision_flags(flags: dict) -> None:
    matmul = torch.backends.cuda.matmul
    owners = {"cuda.matmul": matmul, "cudnn": torch.backends.cudnn, "cudnn.conv": torch.backends.cudnn.conv,
              "cudnn.rnn": torch.backends.cudnn.rnn}
    for name, value in flags.items():
        if name in owners:
            owners[name].fp32_precision = value
        elif name == "matmul.allow_tf32":
            matmul.allow_tf32 = value
        elif name == "cudnn.allow_tf32":
            torch.backends.cudnn.allow_tf32 = value
        else:
            setattr(matmul, name, value)


def _deterministic():
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _random_state():
    """The CPU generator's state, and each CUDA device's where CUDA is initialised (a fresh process starts both
    from their defaults; a worker must not hand a cell the state the last one left)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_random_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


# Every process-wide torch setting a torch-based runner may change in a cell (itself or through the library it
# runs), one `restored` each: harness.run.cell_state.
CELL_STATE = {
    "default dtype": lambda: restored(torch.get_default_dtype, torch.set_default_dtype),
    "intra-op threads": lambda: restored(torch.get_num_threads, torch.set_num_threads),
    "grad mode": lambda: restored(torch.is_grad_enabled, torch.set_grad_enabled),
    "deterministic algorithms": lambda: restored(_deterministic, lambda s: torch.use_deterministic_algorithms(
        s[0], warn_only=s[1])),
    "TF32 and reduced-precision switches": lambda: restored(_precision_flags, _write_precision_flags),
    "cudnn.deterministic": lambda: attribute_restored(torch.backends.cudnn, "deterministic"),
    "cudnn.benchmark": lambda: attribute_restored(torch.backends.cudnn, "benchmark"),
    "random generators": lambda: restored(_random_state, _set_random_state),
}


def cell_state():
    """Around one cell: every setting of ``CELL_STATE`` put back when it ends."""
    return all_restored(CELL_STATE)


def release() -> None:
    """Between a worker's cells: drop what the last cell left (its tensors, cached device memory)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def provenance(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_blas": _torch_build_line("Math Kernel Library") or _torch_build_line("BLAS"),
            "torch_onednn": _torch_build_line("MKL-DNN"), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"gpu": props.name, "gpu_capability": f"{props.major}.{props.minor}",
                     "gpu_driver": gpu_driver_version(), "cuda_runtime": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), **cublas_versions(),
                     "preferred_blas_library": str(torch.backends.cuda.preferred_blas_library())})
    return info


@functools.cache  # a worker's every cell asks; the libraries a process mapped do not change
def cublas_versions() -> dict:
    """The cuBLAS and cuBLASLt this process loaded (read from the libraries torch mapped, not from headers)."""
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")  # make sure the libraries are mapped
    found = {}
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        name = os.path.basename(path)
        if name.startswith("libcublas.so") and "cublas" not in found:
            found["cublas"] = _library_version(path, "cublasGetProperty")
        elif name.startswith("libcublasLt.so") and "cublasLt" not in found:
            found["cublasLt"] = _library_version(path, "cublasLtGetProperty")
    return found or {"cublas": "not mapped into this process"}


def _library_version(path: str, getter: str) -> str:
    """major.minor.patch via cublas(Lt)GetProperty(MAJOR_VERSION=0, MINOR_VERSION=1, PATCH_LEVEL=2, int*)."""
    try:
        function = getattr(ctypes.CDLL(path), getter)
    except (OSError, AttributeError) as error:
        return f"unknown ({getter}: {error}) ({path})"
    parts = []
    for prop in (0, 1, 2):
        value = ctypes.c_int()
        if function(prop, ctypes.byref(value)) != 0:
            return f"unknown ({getter} failed) ({path})"
        parts.append(str(value.value))
    return ".".join(parts) + f" ({path})"


@functools.cache  # one nvidia-smi per process, not one per cell
def gpu_driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


@functools.cache
def _torch_build_line(marker: str) -> str | None:
    for line in torch.__config__.show().splitlines():
        if marker in line:
            return line.strip(" -")
    return None
