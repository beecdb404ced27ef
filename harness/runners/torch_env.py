"""Device setup, determinism settings and provenance shared by the torch-based runners (imports torch only)."""

from __future__ import annotations

import ctypes
import subprocess

import torch

from harness.runners.protocol import Unsupported

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def select_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unsupported(f"torch {torch.__version__} sees no CUDA device (built with CUDA {torch.version.cuda})")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def apply_determinism(device: torch.device) -> dict:
    """The settings real alignment runs use: no TF32, no reduced-precision reductions, deterministic algorithms."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    return {
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


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
                     "cuda_runtime": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                     "cublas": cublas_version(), "gpu_driver": gpu_driver_version()})
    return info


def cublas_version() -> str | None:
    """The cuBLAS actually loaded by this process (read from the library torch mapped, not from a header)."""
    torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda").squeeze(0)
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libcublas.so" in path:
            lib = ctypes.CDLL(path)
            parts = []
            for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
                value = ctypes.c_int()
                lib.cublasGetProperty(prop, ctypes.byref(value))
                parts.append(str(value.value))
            return ".".join(parts) + f" ({path})"
    return None


def gpu_driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _torch_build_line(marker: str) -> str | None:
    for line in torch.__config__.show().splitlines():
        if marker in line:
            return line.strip(" -")
    return None
