"""Which Paddle dygraph kernels exist on this device in a dtype, found by running each once on a 2 x 2 tensor.

Paddle's CPU build registers few bf16 kernels (no matmul, silu, softmax: see /work/shared/platform-notes.md);
asking the framework is the only reliable answer, so the levels (``paddle_formers``) and the doctor use this.
"""

from __future__ import annotations

from functools import cache

import paddle
import paddle.nn.functional as F

# kernel name -> a call that needs it (x: a 2 x 2 tensor of the dtype being asked about)
PROBES = {
    "matmul": lambda x: paddle.matmul(x, x),
    "multiply": lambda x: x * x,
    "silu": lambda x: F.silu(x),
    "softmax": lambda x: F.softmax(x, axis=-1),
    "rsqrt": lambda x: paddle.rsqrt(x),
    "embedding": lambda x: F.embedding(paddle.to_tensor([0, 1]), x),
    "fused_rms_norm_ext": lambda x: _fused_rms_norm(x),
    "swiglu": lambda x: F.swiglu(x),
}


def _fused_rms_norm(x):
    from paddle.incubate.nn.functional.fused_rms_norm_ext import fused_rms_norm_ext

    return fused_rms_norm_ext(x, x[0], 1e-6)


@cache
def problem(kernel: str, dtype: str, device: str) -> str | None:
    """None when `kernel` runs in `dtype` on `device` ("cpu" / "gpu"), else Paddle's first line saying it is not
    registered. Any other failure is no answer about the kernel (a broken install, a bug): it is raised."""
    place = paddle.CPUPlace() if device == "cpu" else paddle.CUDAPlace(0)
    x = paddle.to_tensor([[1.0, 2.0], [3.0, 4.0]], place=place).astype(dtype)
    try:
        PROBES[kernel](x)
        return None
    except Exception as error:  # Paddle raises NotFoundError / RuntimeError from C++
        said = next((line.strip() for line in str(error).splitlines() if "not registered" in line), None)
        if said is None:
            raise
        return said[:300]


def missing(kernels, dtype: str, device: str) -> str | None:
    """A sentence naming the kernels of `kernels` that do not run here, or None."""
    absent = [(k, problem(k, dtype, device)) for k in kernels]
    absent = [(k, why) for k, why in absent if why]
    if not absent:
        return None
    return "; ".join(f"no {dtype} {k} kernel on {device} ({why})" for k, why in absent)


def table(device: str, dtypes=("bfloat16", "float32")) -> dict[str, dict[str, str]]:
    """kernel -> dtype -> "ok" or why not: the doctor's kernel list."""
    return {k: {d: problem(k, d, device) or "ok" for d in dtypes} for k in PROBES}
