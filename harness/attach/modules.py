"""Module capture at chosen steps of a user's torch loop (``StepRecorder(..., modules_at=[k, ...])``, docs/attach.md):
at step k, every module output of each micro-batch's forward, in the model level's canonical module names, written
to ``modules/step{k:05d}.safetensors`` beside the step files (``mb{i}.module.<canonical module>``), so that
``compare-runs`` names the first divergent module at the first divergent step (``harness.compare.module_steps``).

The capture is the model level's own (``harness.capture.torch.Capture`` over the family's ``[hf.modules]`` name map
and its module list, ``Family.modules``): one per micro-batch, started by a pre-hook on the model's top-level forward.
It clones what the forward produced and changes nothing.
"""

from __future__ import annotations

from harness.capture import micro_batch_key
from harness.capture.torch import Capture
from harness.families import family_of
from harness.families.names import NameMap


class ModuleSteps:
    """The hooks of ``modules_at``: `current_step()` says which step the loop is in (the recorder's count + 1)."""

    def __init__(self, model, m, steps, current_step):
        self.model, self.steps, self.current_step = model, set(steps), current_step
        self.name_map = NameMap.load(m.family, "hf", model=m)
        self.names = [spec.name.removeprefix("module.") for spec in family_of(m.family).modules(m, 1)]
        self.captures: list[Capture] = []  # this step's, one per micro-batch, finished
        self.open: Capture | None = None
        self.not_captured: dict[str, str] = {}
        self.handle = model.register_forward_pre_hook(self._start)

    def _start(self, module, args) -> None:
        if self.current_step() not in self.steps:
            return
        self._finish_last()
        self.open = Capture(self.model, self.name_map, 0)
        self.open.watch(self.names)

    def _finish_last(self) -> None:
        if self.open is not None:
            self.open.finish()
            self.captures.append(self.open)
            self.open = None

    def take(self) -> dict:
        """This step's module outputs ({mb{i}.module.<name>: tensor}, on the CPU); the captures end."""
        self._finish_last()
        tensors = {micro_batch_key(i, name): tensor.detach().to("cpu").contiguous()
                   for i, capture in enumerate(self.captures) for name, tensor in capture.tensors.items()}
        for capture in self.captures:
            self.not_captured.update(capture.not_captured)
        self.captures = []
        return tensors

    def close(self) -> None:
        self._finish_last()
        self.handle.remove()
