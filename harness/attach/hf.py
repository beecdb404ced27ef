"""The HF ``Trainer`` captured step by step (``transformers.Trainer``, and what is built on it: ms-swift's trainers):
two lines for the user (docs/attach.md)::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach(trainer, "runs/hf", model_config={"family": "deepseek_v3", ...})
    trainer.train()

``StepRecorderCallback`` is a ``TrainerCallback``; the events the Trainer gives a callback say when (a step begins,
the optimizer is about to step, it has stepped) but not what (the micro-batches' losses, the gradients before
clipping, the norm and the factor the clipping applied). Two observers on the trainer instance, which change nothing
and are put back when training ends, see those where the Trainer computes them:

- ``accelerator.backward``: the tensor it calls ``.backward()`` on, the micro-batch's loss as backpropagated (after
  the Trainer's division by the accumulation steps and, in transformers 5.3.0 with accelerate 1.15, accelerate's
  second division by them: transformers issue 45305, fixed upstream by PR 45349);
- ``accelerator.clip_grad_norm_`` (the Trainer's clipping, and with ``max_grad_norm = 0`` its norm at an infinite
  maximum): the gradients just before it (``StepRecorder.grads``), its returned norm, and the factor
  ``torch.nn.utils.clip_grad_norm_`` multiplied them by (the hf_model runner's own observer,
  ``harness.runners.torch.hf_train.ClipFactor``: the output of its one ``torch.clamp``).

Then ``on_optimizer_step`` (after ``optimizer.step()``, before the scheduler steps and the gradients are zeroed)
records the step with the lr the step used. An error of an observer or of the recording stops the recording
(``StepRecorder.guard``: a note in meta.json, one warning), never the Trainer.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

from harness.attach.torch import StepRecorder, decay_style, never_loaded, state_step
from harness.runners.torch.hf_train import ClipFactor

RUNNER = "hf_trainer"


class Backpropagated(TorchFunctionMode):
    """Observes, changing nothing, the tensor ``accelerator.backward`` calls ``.backward()`` on: the micro-batch's loss
    as backpropagated, after every scaling the Trainer and accelerate apply (the Trainer's division by the
    accumulation steps, and accelerate's own where it divides again)."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:
            self.seen.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))

    def loss(self) -> torch.Tensor:
        if len(self.seen) != 1:
            raise RuntimeError(f"accelerator.backward called Tensor.backward {len(self.seen)} times; the observer "
                               "expects once (a loss scaler or DeepSpeed's engine: not observed here)")
        return self.seen[0]


def attach(trainer, folder, *, model_config: dict, steps_kept="auto", modules_at=(),
           digest_on_device: bool | None = None, state_from=None):
    """A ``StepRecorderCallback`` added to `trainer`; returns it. `model_config`: the model's config in the harness's
    form (``{"family": ..., <the family's HF config keys>}``, a training case's ``config.model``), or a model of its
    own's (``{"family": "own"}``, optionally ``"name_map": FILE``: ``harness.families.own``); `state_from`: a state
    folder (``python -m harness state-for``) the step after its step starts from (``StepRecorder.load_state``); the
    other options are ``StepRecorder``'s."""
    callback = StepRecorderCallback(trainer, folder, model_config=model_config, steps_kept=steps_kept,
                                    modules_at=modules_at, digest_on_device=digest_on_device, state_from=state_from)
    trainer.add_callback(callback)
    return callback


class StepRecorderCallback(TrainerCallback):
    """Writes `folder`'s step files and meta.json after every optimizer step of `trainer` (see the module)."""

    def __init__(self, trainer, folder, *, model_config: dict, steps_kept="auto", modules_at=(),
                 digest_on_device: bool | None = None, state_from=None):
        self.trainer, self.folder, self.steps_kept, self.model_config = trainer, folder, steps_kept, model_config
        self.modules_at, self.digest_on_device = modules_at, digest_on_device
        self.state_from = state_from  # loaded at the beginning of the step after the one it holds the state of
        self.state_step = None if state_from is None else state_step(state_from)
        self.recorder: StepRecorder | None = None
        self.restore: list = []
        self.losses, self.grads, self.norm, self.factor, self.lr = [], None, None, None, None

    # --- the observers ------------------------------------------------------------------------------------------

    def _observe(self) -> None:
        trainer = self.trainer
        backward, clip = trainer.accelerator.backward, trainer.accelerator.clip_grad_norm_

        def observed_backward(loss, *args, **kwargs):
            observer = Backpropagated()
            with observer:
                result = backward(loss, *args, **kwargs)
            self.recorder.guard(lambda: self.losses.append(observer.loss()))
            return result

        def observed_clip(parameters, max_norm, *args, **kwargs):
            parameters = list(parameters)
            self.grads = self.recorder.grads()
            observer = ClipFactor()
            with observer:
                norm = clip(parameters, max_norm, *args, **kwargs)
            self.norm = norm
            if max_norm != float("inf"):  # inf: a norm, no clipping
                self.factor = self.recorder.guard(observer.factor)
            return norm

        trainer.accelerator.backward, trainer.accelerator.clip_grad_norm_ = observed_backward, observed_clip
        self.restore = [(trainer.accelerator, "backward"), (trainer.accelerator, "clip_grad_norm_")]

    def _unobserve(self) -> None:
        for owner, name in self.restore:
            if name in vars(owner):
                delattr(owner, name)  # the class's method again
        self.restore = []

    # --- the Trainer's events -----------------------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        if self.recorder is None:
            self.recorder = self._recorder(args)
            self._observe()
        if state.global_step == self.state_step:
            self.recorder.load_state(self.state_from)  # raises (the Trainer stops) rather than train un-re-fed
        self.losses, self.grads, self.norm, self.factor, self.lr = [], None, None, None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:  # no clipping call this step: the gradients are the ones the optimizer takes
            self.grads = self.recorder.grads()
        self.lr = self.recorder.guard(self._lr)

    def _lr(self) -> float:
        lrs = {group["lr"] for group in self.recorder.optimizer.param_groups}
        if len(lrs) != 1:
            raise RuntimeError(f"the optimizer's param groups step with different lrs {sorted(lrs)}: one lr a step")
        return lrs.pop()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.recorder.record(state.global_step + 1, self.losses, self.lr, self.grads, self.norm, self.factor)

    def on_train_end(self, args, state, control, **kwargs):
        if self.state_step is not None and self.recorder is not None and self.recorder.refed is None:
            self.recorder.guard(lambda: never_loaded(self.state_from, state.global_step))
        self._unobserve()
        if self.recorder is not None:
            self.recorder.close()

    def _recorder(self, args) -> StepRecorder:
        import transformers

        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        optimizer = trainer.optimizer
        while type(optimizer).__name__ == "AcceleratedOptimizer":
            optimizer = optimizer.optimizer  # accelerate's wrapper: the torch optimizer inside holds the state
        scheduler = args.lr_scheduler_type
        kwargs = dict(args.lr_scheduler_kwargs or {})
        stated = {"clip_grad": float(args.max_grad_norm or 0.0), "warmup_steps": int(args.get_warmup_steps(
            args.max_steps)) if args.max_steps > 0 else 0,
                  "decay_style": decay_style(scheduler),
                  "min_lr": float(kwargs.get("min_lr", 0.0))}
        if args.max_steps > 0:
            stated["decay_steps"] = int(args.max_steps)
        knobs = {
            "optim": {"value": str(args.optim), "why": f"the Trainer's optimizer: torch.optim."
                                                     f"{type(optimizer).__name__} over "
                                                     f"{len(optimizer.param_groups)} param groups"},
            "max_grad_norm": {"value": args.max_grad_norm, "why": "accelerator.clip_grad_norm_ (0: a norm only)"},
            "lr_scheduler_type": {"value": str(scheduler), "why": f"kwargs {kwargs}"},
            "gradient_accumulation_steps": {"value": args.gradient_accumulation_steps, "why": "micro-batches a step"},
            "accelerator.gradient_accumulation_steps": {
                "value": trainer.accelerator.gradient_accumulation_steps,
                "why": "accelerate's backward divides the loss by it again (transformers issue 45305): 1 does not"},
            "model_accepts_loss_kwargs": {"value": trainer.model_accepts_loss_kwargs,
                                          "why": "False: each micro-batch's mean loss / accumulation steps; True: "
                                                 "summed over the step's tokens / their count"},
        }
        adapters = [{"name": "Backpropagated", "why": "the tensor accelerator.backward calls .backward() on: the "
                                                      "micro-batch's loss as backpropagated (an observer)",
                     "changes_computation": False},
                    {"name": "observed_clip_grad_norm_", "why": "the gradients before accelerator.clip_grad_norm_, its "
                                                                "norm, and the factor of its one torch.clamp "
                                                                "(ClipFactor, an observer)",
                     "changes_computation": False}]
        return StepRecorder(self.folder, model, optimizer, self.model_config, steps_kept=self.steps_kept,
                            modules_at=self.modules_at, stated=stated, digest_on_device=self.digest_on_device,
                            runner=RUNNER, implementation=f"transformers.{type(trainer).__name__} "
                                                          f"({type(trainer).__module__}) training "
                                                          f"{type(model).__name__}",
                            knobs=knobs, adapters=adapters, versions={"transformers": transformers.__version__})

