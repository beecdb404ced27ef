"""``PaddleStepRecorder``: a Paddle dygraph training loop over a PaddleFormers model captured step by step in the
built-in runners' step files (docs/attach.md), its state read as paddle_model's training runner reads its own.

``PaddleStates`` is the runner's reader (``harness.runners.paddle.train.Trainer``'s ``source``, ``host``, ``one``
and ``canonical``: each canonical parameter through the family's ``[paddle.grads]`` rule, the optimizer's state from the
accumulators the optimizer's record names) on the user's model and optimizer; what a step writes, in which dtypes, is
the runner's (``Trainer.step``'s scalars, ``_at``, ``_save``). The loop calls ``grads()`` where its gradients are
whole and scaled as the optimizer takes them (before ``optimizer.step()``, which clips inside), then ``record(...)``
after it.
"""

from __future__ import annotations

import numpy as np

from harness.attach.torch import AttachError, StepRecorder
from harness.capture.paddle import to_host
from harness.case.ops import carried_quantities, train_buffer_names, train_state_names
from harness.families.names import NameMap
from harness.runners.paddle.model import paddle
from harness.runners.paddle.train import Trainer as RunnerTrainer
from harness.runners.paddle.train import _at, _save, global_losses


class PaddleStates:
    """paddle_model's runner's reading methods, bound to a user's model and optimizer."""

    source = RunnerTrainer.source
    host = RunnerTrainer.host
    one = RunnerTrainer.one
    canonical = RunnerTrainer.canonical

    def __init__(self, model, optimizer, m, name_map, record):
        self.params, self.optimizer = dict(model.named_parameters()), optimizer
        self.rules = {name: name_map.rule("grads", name) for name, _ in train_state_names(m)}
        self.accumulators = record.paddle_accumulators
        wanted = {name for name, _ in train_buffer_names(m)}  # as the runner: Paddle buffer -> canonical by checkpoint
        self.buffers = {name_map.rule("checkpoint", paddle_name).sources[0]: buffer
                        for paddle_name, buffer in model.named_buffers()
                        if name_map.rule("checkpoint", paddle_name).sources[0] in wanted}
        if set(self.buffers) != wanted:
            raise AttachError(f"routing biases not found in the Paddle model: {sorted(wanted - set(self.buffers))}")


class PaddleStepRecorder(StepRecorder):
    """Writes `folder`'s step files and meta.json for a Paddle loop (arguments as ``StepRecorder``'s; `optimizer` a
    ``paddle.optimizer.AdamW`` or ``Momentum``)."""

    stack = "paddle"

    def __init__(self, folder, model, optimizer, model_config: dict, *, steps_kept="all", stated: dict | None = None,
                 runner: str = "paddle_loop", implementation: str = "", knobs: dict | None = None,
                 adapters: list | None = None, versions: dict | None = None):
        self.model, self.optimizer, self.masters = model, optimizer, {}
        self.device_type = "cpu" if paddle.get_device() == "cpu" else "gpu"
        first = next(iter(model.parameters()))
        self._common(folder, model_config, type(optimizer), str(first.dtype).removeprefix("paddle."), steps_kept,
                     stated, runner, implementation, knobs, adapters, versions)
        self.states = PaddleStates(model, optimizer, self.m, NameMap.load(self.family, "paddle", model=self.m),
                                   self.record_of)
        self.carried = tuple(q for q in carried_quantities(self.record_of) if q != "master")

    def _rank_and_world(self) -> tuple[int, int]:
        if paddle.distributed.is_initialized():
            return paddle.distributed.get_rank(), paddle.distributed.get_world_size()
        return 0, 1

    def _writes(self):
        return _save, lambda a: np.ascontiguousarray(a).view(np.uint8)

    def _versions(self) -> dict:
        return {"paddlepaddle": paddle.__version__, "paddle_commit": paddle.version.commit}

    def _provenance(self) -> dict:
        flags = paddle.get_flags(["FLAGS_use_accuracy_compatible_kernel"])
        return {"framework": "paddle", "device": self.device_type, "paddle_flags": flags}

    def grads(self) -> dict[str, np.ndarray]:
        """The gradients the optimizer is about to consume (canonical host copies): before ``optimizer.step()``."""
        return {f"grad.{name}": value.copy() for name, value in self.states.canonical("grad").items()}

    def record(self, step: int, losses, lr: float, grads: dict, grad_norm=None, clip_coeff=None) -> None:
        """Step `step`'s file, after ``optimizer.step()``: `losses` each micro-batch's share of the step's loss,
        `lr` the lr the step used, `grads` from ``grads()``, `grad_norm` / `clip_coeff` what the clip computed."""
        losses = self._check(step, losses)
        float64 = self.dtype == "float64"
        wide = np.float64 if float64 else np.float32
        loss = global_losses(np.stack([np.asarray(to_host(x)).reshape(()) for x in losses]), self.world)
        scalars = {"lr": np.asarray(lr, dtype=np.float64).reshape(()),
                   "loss": loss.astype(np.float64) if float64 else loss,
                   **{name: _at(wide, name, value) for name, value in (("grad_norm", grad_norm),
                                                                       ("clip_coeff", clip_coeff))
                      if value is not None}}
        self.has_clip = self.has_clip or clip_coeff is not None
        states = dict(grads)
        for quantity in self.carried:
            states.update({f"{quantity}.{name}": value for name, value in self.states.canonical(quantity).items()})
        states.update({f"expert_bias.{name}": to_host(buffer) for name, buffer in self.states.buffers.items()})
        self.writer.write(step, scalars, {name: np.require(v, requirements="C") for name, v in states.items()})
        self.steps.append({"step": step, "lr": float(lr)})
        self.write_meta()

    def _optimizer_fields(self) -> dict:
        optimizer, params = self.optimizer, list(self.states.params.values())
        decide = getattr(optimizer, "_apply_decay_param_fun", None)
        if decide is None:
            shown = "all"
        else:
            exempt = {p.name for p in params if not decide(p.name)}
            shown = "not_1d" if exempt == {p.name for p in params if len(p.shape) <= 1} else "default"
        decay = optimizer._weight_decay
        lr = optimizer._learning_rate
        base = float(getattr(lr, "base_lr", lr)) if not isinstance(lr, (int, float)) else float(lr)
        fields = {"lr": base, "weight_decay": float(getattr(decay, "_coeff", decay) or 0.0),
                  "weight_decay_params": shown}
        if self.record_of.name == "adamw":
            return {**fields, "betas": [float(optimizer._beta1), float(optimizer._beta2)],
                    "eps": float(optimizer._epsilon), "torch_adamw": "default"}
        return {**fields, "optimizer": "sgd", "momentum": float(optimizer._momentum)}

    def _has_masters(self) -> bool:
        return False
