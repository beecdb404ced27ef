"""What every level of the Paddle runner (PaddleFleet, PaddleFormers, the recipe) does the same way: make tensors,
set parameters, time forward and backward through the kernel guard. Imports paddle: runner side only."""

from __future__ import annotations

import gc

import numpy as np
import paddle


def load_checkpoint(files: list[str]) -> dict[str, np.ndarray]:
    """The request's checkpoint (``request["checkpoint"]``: its files) as numpy arrays, bf16 as uint16 bits."""
    from safetensors.paddle import load_file

    from harness.run.protocol import read_checkpoint

    return read_checkpoint(files, lambda path: {name: tensor.numpy() for name, tensor in load_file(path).items()})


TRANSPOSE_ROWS = 256  # rows per block: a block's columns still fit in cache when written as rows


def transposed(array) -> np.ndarray:
    """A 2-D array's transpose, contiguous (Megatron's [out, in] <-> Paddle's [in, out]: moves bits, changes none).
    Copied in blocks of rows: numpy's one-shot copy of a strided 2-byte transpose is several times slower (measured
    0.21 s against 0.04 s for the 4096 x 7168 fc1 weight), and every cell of a sweep pays it twice."""
    array = np.asarray(array)
    if array.ndim != 2:
        raise ValueError(f"transposed() takes a 2-D array (got shape {array.shape})")
    rows = array.shape[0]
    out = np.empty(array.shape[::-1], array.dtype)
    for start in range(0, rows, TRANSPOSE_ROWS):
        out[:, start:start + TRANSPOSE_ROWS] = array[start:start + TRANSPOSE_ROWS].T
    return out


def as_tensor(array, trainable=True):
    tensor = paddle.to_tensor(array)
    tensor.stop_gradient = not trainable
    return tensor


def set_param(parameter, array):
    parameter.set_value(paddle.to_tensor(np.ascontiguousarray(array)).astype(parameter.dtype))


def run_phases(request, phases, guard, kernel, forward, backward):
    """Forward then backward, each timed and synchronised; `guard` turns a missing kernel into UNSUPPORTED."""
    with phases("forward"):
        out = guard(forward, kernel, request)
        sync(request)
    with phases("backward"):
        guard(lambda: backward(out), kernel + " backward", request)
        sync(request)
    return out


def release() -> None:
    """Between a worker's cells: drop what the last cell left (its tensors, cached device memory)."""
    gc.collect()
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        paddle.device.cuda.empty_cache()


def sync(request):
    if request["device"] == "gpu":
        paddle.device.synchronize()
