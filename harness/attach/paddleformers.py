"""PaddleFormers' ``Trainer`` captured step by step (``paddleformers.trainer.Trainer``; docs/attach.md)::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach(trainer, "runs/paddleformers", model_config={"family": "deepseek_v3", ...})
    trainer.train()

``StepRecorderCallback`` is a PaddleFormers ``TrainerCallback``. Its events: ``on_optimizer_begin`` comes after the
Trainer has scaled the accumulated gradients by 1 / accumulation steps (PaddleFormers backpropagates each micro-batch's
loss unscaled and scales the sum), before ``optimizer.step()`` (which clips inside, ``ClipGradByGlobalNorm``):
the gradients are read there, with the lr. Around the step, the paddle_model runner's own observer
(``harness.runners.paddle.train.clip_norm_and_factor``: the outputs of the clip's one ``paddle.sqrt`` and one
``paddle.divide``) sees the norm and the factor; ``on_optimizer_end`` records the step. One observer on the trainer
instance, removed when training ends, keeps each micro-batch's share of the step's loss: ``training_step``'s return
value (the loss / accumulation steps).

An error in these events stops the recording (the recorder's ``guard``: meta.json says at which step and why),
never the training; a loop the recorder cannot describe is refused when it is built, at the first step.
"""

from __future__ import annotations

from contextlib import ExitStack

from paddleformers.trainer import TrainerCallback

from harness.attach.paddle import PaddleStepRecorder
from harness.attach.torch import decay_style, never_loaded, state_step
from harness.runners.paddle.train import clip_norm_and_factor

RUNNER = "paddleformers_trainer"


def attach(trainer, folder, *, model_config: dict, steps_kept="all", modules_at=(), state_from=None):
    """A ``StepRecorderCallback`` added to `trainer`; returns it. `modules_at`: as ``PaddleStepRecorder``'s;
    `state_from`: a state folder (``python -m harness state-for``) the step after its step starts from
    (``StepRecorder.load_state``)."""
    callback = StepRecorderCallback(trainer, folder, model_config=model_config, steps_kept=steps_kept,
                                    modules_at=modules_at, state_from=state_from)
    trainer.add_callback(callback)
    return callback


class StepRecorderCallback(TrainerCallback):
    def __init__(self, trainer, folder, *, model_config: dict, steps_kept="all", modules_at=(), state_from=None):
        self.trainer, self.folder, self.steps_kept, self.model_config = trainer, folder, steps_kept, model_config
        self.modules_at = modules_at
        self.state_from = state_from  # loaded at the beginning of the step after the one it holds the state of
        self.state_step = None if state_from is None else state_step(state_from)
        self.recorder: PaddleStepRecorder | None = None
        self.losses, self.grads, self.lr, self.seen = [], None, None, None
        self.around_step = ExitStack()

    def _observe(self) -> None:
        training_step = self.trainer.training_step

        def observed_training_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            self.losses.append(loss.detach().clone())
            return loss

        self.trainer.training_step = observed_training_step

    def on_step_begin(self, args, state, control, **kwargs):
        if self.recorder is None:
            self.recorder = self._recorder(args)
            self._observe()
        if state.global_step == self.state_step:
            self.recorder.load_state(self.state_from)  # raises (the Trainer stops) rather than train un-re-fed
        self.losses, self.grads, self.lr, self.seen = [], None, None, None

    def on_optimizer_begin(self, args, state, control, **kwargs):
        self.recorder.guard(self._before_step, state.global_step + 1)

    def _before_step(self) -> None:
        self.grads, self.lr = self.recorder.grads(), self.recorder.optimizer.get_lr()
        clip = getattr(self.recorder.optimizer, "_grad_clip", None)
        self.seen = self.around_step.enter_context(clip_norm_and_factor(clip)) if clip is not None else None

    def on_optimizer_end(self, args, state, control, **kwargs):
        self.around_step.close()
        self.recorder.guard(lambda: self._record(state.global_step + 1), state.global_step + 1)

    def _record(self, step: int) -> None:
        norm = factor = None
        if self.seen is not None:
            if len(self.seen["sqrt"]) != 1 or len(self.seen["divide"]) != 1:
                raise RuntimeError(f"ClipGradByGlobalNorm called paddle.sqrt {len(self.seen['sqrt'])} and "
                                   f"paddle.divide {len(self.seen['divide'])} times; the observer expects once each")
            norm, factor = self.seen["sqrt"][0], self.seen["divide"][0]
        self.recorder.record(step, self.losses, self.lr, self.grads, norm, factor)

    def on_train_end(self, args, state, control, **kwargs):
        if self.state_step is not None and self.recorder is not None and self.recorder.refed is None:
            self.recorder.guard(lambda: never_loaded(self.state_from, state.global_step))
        self.around_step.close()
        vars(self.trainer).pop("training_step", None)
        if self.recorder is not None:
            self.recorder.close()

    def _recorder(self, args) -> PaddleStepRecorder:
        import paddleformers

        trainer = self.trainer
        stated = {"clip_grad": float(args.max_grad_norm or 0.0), "min_lr": float(getattr(args, "min_lr", 0.0)),
                  "warmup_steps": int(args.warmup_steps or 0),
                  "decay_style": decay_style(args.lr_scheduler_type)}
        if args.max_steps > 0:
            stated["decay_steps"] = int(args.max_steps)
        knobs = {"lr_scheduler": {"value": type(trainer.lr_scheduler).__name__,
                                  "why": f"lr_scheduler_type {args.lr_scheduler_type}"},
                 "max_grad_norm": {"value": args.max_grad_norm, "why": "ClipGradByGlobalNorm in the optimizer"},
                 "gradient_accumulation_steps": {"value": args.gradient_accumulation_steps,
                                                 "why": "each micro-batch's loss backpropagated unscaled, the summed "
                                                        "gradients scaled by 1 / accumulation steps"}}
        adapters = [{"name": "observed_training_step", "why": "Trainer.training_step's return value, the micro-batch's "
                                                              "share of the step's loss (an observer)",
                     "changes_computation": False},
                    {"name": "clip_norm_and_factor", "why": "the norm and factor ClipGradByGlobalNorm computes (the "
                                                            "paddle_model runner's observer)",
                     "changes_computation": False}]
        return PaddleStepRecorder(self.folder, trainer.model, trainer.optimizer, self.model_config,
                                  steps_kept=self.steps_kept, modules_at=self.modules_at, stated=stated,
                                  runner=RUNNER,
                                  implementation=f"paddleformers.trainer.{type(trainer).__name__} training "
                                                 f"{type(trainer.model).__name__}",
                                  knobs=knobs, adapters=adapters,
                                  versions={"paddleformers": getattr(paddleformers, "__version__", "unknown")})
