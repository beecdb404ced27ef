"""Per-module md5 dump hooks for a user's torch or Paddle model, in the line format of PaddleFleet's alignment dumps,
so that ``compare-runs --hook-dumps`` (``harness.compare.hook_dumps``) can name the first module whose output,
input or output gradient departs between two runs.

The format is the one ``src/paddlefleet/align_dump_utils.py`` prints (PaddlePaddle/PaddleFleet at commit
6b77ba8f1dba51fed5fe040b43fe3290566578e3, ``pf_dump_forward`` and ``pf_dump_grad_hook``): one line per tensor,
``[DUMP PF] forward step{N} {module}/{name} md5={H} shape={S}`` and ``[DUMP PF] grad {module}/{name} step{N} md5={H}
shape={S}``, H the first 16 hex digits of the md5 of the tensor cast to float32, S the shape as a Python tuple, N how
many times that module (forward) or that tensor of it (grad) was dumped. This writer uses that format with the
module's own name (``named_modules`` / ``named_sublayers``) and the quantities ``input`` and ``output`` (each module's
first tensor of each, printed when its forward returns) and ``grad`` (the gradient of that output: a hook on the output
tensor), one file per rank.

It changes nothing: it reads each tensor and returns nothing from its hooks, so the model computes what it would
without them (tests/test_hook_dumps.py checks the parameters after training, with and without it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

GRAD = "grad"


def md5_16(array: np.ndarray) -> str:
    """The md5 PaddleFleet's dumps print: of the tensor's float32 bytes, its first 16 hex digits."""
    return hashlib.md5(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()[:16]


class DumpHooks:
    """Forward hooks on every sub-module of `model` (torch ``nn.Module`` or Paddle ``nn.Layer``) that append a module's
    output, input and output-gradient md5s to `path` (``side`` is the tag in brackets: ``PF``, ``MG``, ...).
    ``close()`` removes the hooks and closes the file."""

    def __init__(self, model, path, side: str = "PF"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            raise FileExistsError(f"{self.path} exists: a dump never overwrites an earlier run's")
        self.file = self.path.open("w")
        self.side = side
        self.calls: dict[str, int] = {}
        self.grads: dict[str, int] = {}
        named = model.named_sublayers() if hasattr(model, "named_sublayers") else model.named_modules()
        self.handles = [self._register(module, name) for name, module in named if name]

    def _register(self, module, name: str):
        hook = self._forward(name)
        if hasattr(module, "register_forward_post_hook"):  # Paddle
            return module.register_forward_post_hook(hook)
        return module.register_forward_hook(hook)

    def _forward(self, name: str):
        def hook(module, inputs, output):
            count = self.calls[name] = self.calls.get(name, 0) + 1
            first_output = _first_tensor(output)
            for quantity, tensor in (("input", _first_tensor(inputs)), ("output", first_output)):
                if tensor is not None:
                    self._line(f"forward step{count} {name}/{quantity}", tensor)
            if first_output is not None and _trains(first_output):
                first_output.register_hook(self._grad(name))
        return hook

    def _grad(self, name: str):
        def hook(grad):
            count = self.grads[name] = self.grads.get(name, 0) + 1
            self._line(f"grad {name}/{GRAD} step{count}", grad)
        return hook

    def _line(self, what: str, tensor) -> None:
        array = _numpy(tensor)
        self.file.write(f"[DUMP {self.side}] {what} md5={md5_16(array)} shape={tuple(array.shape)}\n")

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.file.close()


def _first_tensor(value):
    """A module's output or inputs: the tensor itself, or the first tensor of a tuple, list or model output."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return next((item for item in items if hasattr(item, "shape") and hasattr(item, "dtype")), None)


def _is_torch(tensor) -> bool:
    return type(tensor).__module__.startswith("torch")


def _trains(tensor) -> bool:
    """Whether a gradient will reach the tensor (torch: requires_grad; Paddle: not stop_gradient)."""
    return bool(tensor.requires_grad) if _is_torch(tensor) else not tensor.stop_gradient


def _numpy(tensor) -> np.ndarray:
    detached = tensor.detach()
    return detached.cpu().float().numpy() if _is_torch(tensor) else detached.cast("float32").numpy()
