"""Module capture at chosen steps of a user's torch or Paddle loop (``StepRecorder(..., modules_at=[k, ...])``,
``PaddleStepRecorder(...)`` alike; docs/attach.md):
at step k, every module output of each micro-batch's forward and the gradient that reached it in the backward, in
the model level's canonical module names, written to ``modules/step{k:05d}.safetensors`` beside the step files
(``mb{i}.module.<canonical module>``, ``mb{i}.refeed.grad_output.<canonical module>``), so that ``compare-runs`` names
the first divergent module at the first divergent step (``harness.compare.module_steps``).

The capture is the model level's own, over the family's ``[hf.modules]`` (``[paddle.modules]``) name map and its
module list (``Family.modules``): the framework's ``Capture`` (``harness.capture.torch``, ``harness.capture.paddle``)
for the outputs and its re-feed's recording (``Refeed`` in "record" mode, the same units as the hf_model and
paddle_model runners') for the output gradients; one of each per micro-batch, started by a pre-hook on the model's
top-level forward. Both copy what the step produced and change nothing.
"""

from __future__ import annotations

import json
from importlib import import_module

import numpy as np

from harness.capture import EXPERT_WHY, GRAD, MODULE_ORDER, micro_batch_key, refeed_units
from harness.families import family_of
from harness.families.names import NameMap


class ModuleSteps:
    """The hooks of ``modules_at``: `current_step()` says which step the loop is in (the recorder's count + 1; None
    once its recording stopped); `own`: a model without a family record's names (``OwnNames``), else None; `stack`:
    the family's name-map section and so the framework ("hf": torch, "paddle"); `modules`: the model's module names
    (a model of its own's, captured where no map names them)."""

    def __init__(self, model, m, steps, current_step, own=None, stack: str = "hf", modules=()):
        self.model, self.steps, self.current_step, self.own = model, set(steps), current_step, own
        framework = import_module("harness.capture.paddle" if stack == "paddle" else "harness.capture.torch")
        self.capture_class, self.refeed_class = framework.Capture, framework.Refeed
        if own is None:
            self.name_map = NameMap.load(m.family, stack, model=m)
            self.names = [spec.name.removeprefix("module.") for spec in family_of(m.family).modules(m, 1)]
            extra = {"lm_head": ["lm_head"]}
        else:
            self.name_map = own.name_map()
            self.names, extra = own.modules(list(modules)), {}
        self.units, why_not = refeed_units(self.names, lambda n: self.name_map.rule("modules", n, m),
                                           extra=extra, skip={r"\.experts\.\d+$": EXPERT_WHY})
        self.not_captured = {GRAD + name: why for name, why in why_not.items()}
        self.captures: list[dict] = []  # this step's tensors, one dict per micro-batch
        self.order: list[str] = []  # the canonical modules in the order the first micro-batch's forward reached them
        self.open: tuple | None = None  # this micro-batch's (Capture, Refeed)
        self.handle = model.register_forward_pre_hook(self._start)

    def _start(self, module, args) -> None:
        if self.current_step() not in self.steps:
            return
        self._finish_last()
        capture = self.capture_class(self.model, self.name_map, 0)
        capture.watch(self.names)
        self.open = (capture, self.refeed_class(self.model, self.units, "record", batch_dim=0))

    def _finish_last(self) -> None:
        """The open micro-batch's module outputs and output gradients (its backward is done: the next forward or
        ``record`` came)."""
        if self.open is None:
            return
        capture, refeed = self.open
        capture.finish()
        grads = {name: tensor for name, tensor in refeed.finish().items() if name.startswith(GRAD)}
        self.not_captured.update(capture.not_captured)
        if not self.order:
            ran = {path: i for i, path in enumerate(capture.ran)}
            reached = {name: min(ran.get(s, len(ran)) for s in self.name_map.rule("modules", name).sources or [""])
                       for name in self.names}
            self.order = sorted(reached, key=reached.get)
        self.captures.append({**capture.tensors, **grads})
        self.open = None

    def take(self) -> dict:
        """This step's tensors ({mb{i}.<name>: tensor}, on the CPU); the captures end."""
        self._finish_last()
        tensors = {micro_batch_key(i, name): _on_host(tensor)
                   for i, held in enumerate(self.captures) for name, tensor in held.items()}
        self.captures = []
        return tensors

    def metadata(self) -> dict:
        """The module file's metadata: the forward's order of a model of its own's modules (a family's is its
        record's)."""
        return {MODULE_ORDER: json.dumps(self.order)} if self.own is not None else {}

    def close(self) -> None:
        self._finish_last()
        self.handle.remove()


def _on_host(tensor):
    """A torch capture's tensor on the CPU, contiguous; a Paddle capture's numpy array (already on the host) as it is,
    contiguous."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor)
    return tensor.detach().to("cpu").contiguous()
