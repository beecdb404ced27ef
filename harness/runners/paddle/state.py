"""What a Paddle cell may change in its process, put back when the cell ends (``harness.run.cell_state``), for the
op runner and the whole-model runner alike (``serve(..., cell_state=...)``).

- static graph mode: the recipe's bf16 linear on a CPU runs in a static Program (``paddle.enable_static()``) and
  goes back to dygraph only when it gets that far: a cell that stops on a missing kernel left the process static;
- global flags: the same linear sets ``FLAGS_use_onednn``; PaddleFleet and PaddleFormers may set others. Every
  flag of Paddle's registry is read before the cell and the ones it changed are written back;
- the default dtype: the model runner and the levels create parameters in the case's dtype;
- the random generators: the model runner seeds them (``paddle.seed``) before building the model;
- the device (``paddle.set_device``).
``os.environ`` (``NVIDIA_TF32_OVERRIDE``) is put back by the protocol for every runner.
"""

from __future__ import annotations

import paddle

from harness.run.cell_state import all_restored, restored


def _dynamic() -> bool:
    return paddle.in_dynamic_mode()


def _set_dynamic(dynamic: bool) -> None:
    if dynamic and not paddle.in_dynamic_mode():
        paddle.disable_static()
    elif not dynamic and paddle.in_dynamic_mode():
        paddle.enable_static()


def _flags() -> dict:
    registry = paddle.base.core.globals()
    return {name: registry[name] for name in registry.keys()}


def _set_flags(saved: dict) -> None:
    registry = paddle.base.core.globals()
    for name, value in saved.items():
        if registry[name] != value:
            registry[name] = value


def _gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def _random_state() -> dict:
    return {device: paddle.get_rng_state(device) for device in ("cpu", "gpu") if device == "cpu" or _gpu()}


def _set_random_state(saved: dict) -> None:
    for device, state in saved.items():
        paddle.set_rng_state(state, device)


# One `restored` per process-wide Paddle setting a cell may change (entered in this order, put back in reverse).
CELL_STATE = {
    "static graph mode": lambda: restored(_dynamic, _set_dynamic),
    "global flags (FLAGS_*)": lambda: restored(_flags, _set_flags),
    "default dtype": lambda: restored(paddle.get_default_dtype, paddle.set_default_dtype),
    "random generators": lambda: restored(_random_state, _set_random_state),
    "device": lambda: restored(paddle.get_device, paddle.set_device),
}


def cell_state():
    """Around one cell: every setting of ``CELL_STATE`` put back when it ends."""
    return all_restored(CELL_STATE)
