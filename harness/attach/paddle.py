"""``PaddleStepRecorder``: a Paddle dygraph training loop over a PaddleFormers model captured step by step in the
built-in runners' step files (docs/attach.md), its state read as paddle_model's training runner reads its own.

``PaddleStates`` is the runner's reader (``harness.runners.paddle.train.Trainer``'s ``source``, ``host``, ``one``
and ``canonical``: each canonical parameter through the family's ``[paddle.grads]`` rule, the optimizer's state from the
accumulators the optimizer's record names) on the user's model and optimizer; what a step writes, in which dtypes, is
the runner's (``Trainer.step``'s scalars, ``_at``, ``_save``). The loop calls ``grads()`` where its gradients are
whole and scaled as the optimizer takes them (before ``optimizer.step()``, which clips inside), then ``record(...)``
after it.

It changes nothing in the loop (issue 40): a parameter without a gradient is written as the zeros Paddle would start
from, its ``grad`` left None (meta.json's ``zero_grads`` names it per step, as the runner's); an error while recording
stops the recording, not the training (the base class's ``guard``: meta.json's ``capture.stopped``, one warning). What
it cannot describe is refused when it is built (``AttachError``): a trained parameter no name-map rule reads, an
optimizer setting its record lacks (``harness.attach.paddle_optimizer``), several ranks (one rank's loop is what is
tested).
"""

from __future__ import annotations

import numpy as np

from harness.attach import paddle_optimizer
from harness.attach.modules import ModuleSteps
from harness.attach.torch import AttachError, StepRecorder
from harness.capture import module_file
from harness.capture.paddle import to_host
from harness.case.ops import carried_quantities, train_buffer_names, train_state_names
from harness.runners.paddle.model import paddle
from harness.runners.paddle.train import Trainer as RunnerTrainer
from harness.runners.paddle.train import _at, _save, global_losses

FLEET = "paddlefleet"  # the name-map section of PaddleFleet's GPTModel (harness/families/glm4_moe/names.toml)


class PaddleStates:
    """paddle_model's runner's reading methods, bound to a user's model and optimizer."""

    source = RunnerTrainer.source
    host = RunnerTrainer.host
    one = RunnerTrainer.one
    canonical = RunnerTrainer.canonical
    without_gradient = RunnerTrainer.without_gradient
    put = RunnerTrainer.put  # and its writing methods (a state loaded before a step: ``load_state``)
    create = RunnerTrainer.create

    def __init__(self, model, optimizer, m, name_map, record, described: str):
        self.params, self.optimizer = single_names(model.named_parameters(), model), optimizer
        self.rules = {name: name_map.rule("grads", name) for name, _ in train_state_names(m)}
        read = {source for rule in self.rules.values() for source in rule.sources}
        if read - set(self.params):
            raise AttachError(f"{described} reads {sorted(read - set(self.params))[0]}, "
                              f"which the model has not ({len(read - set(self.params))} such): is it the family's "
                              "PaddleFormers model (not wrapped, e.g. in paddle.DataParallel)?")
        names = {id(param): name for name, param in self.params.items()}
        unread = [names.get(id(p), p.name) for p in _trained(optimizer) if names.get(id(p)) not in read]
        if unread:
            raise AttachError(f"trained parameter {unread[0]} ({len(unread)} such) is read by no rule of {described}: "
                              "its state would never be recorded or compared")
        self.accumulators = record.paddle_accumulators
        wanted = {name for name, _ in train_buffer_names(m)}  # as the runner: Paddle buffer -> canonical by checkpoint
        self.buffers = {name_map.rule("checkpoint", paddle_name).sources[0]: buffer
                        for paddle_name, buffer in single_names(model.named_buffers(), model).items()
                        if name_map.rule("checkpoint", paddle_name).sources[0] in wanted}
        if set(self.buffers) != wanted:
            raise AttachError(f"routing biases not found in the Paddle model: {sorted(wanted - set(self.buffers))}")


class PaddleStepRecorder(StepRecorder):
    """Writes `folder`'s step files and meta.json for a Paddle loop (arguments as ``StepRecorder``'s; `optimizer` a
    ``paddle.optimizer.AdamW`` or ``Momentum``)."""

    stack = "paddle"

    def __init__(self, folder, model, optimizer, model_config: dict, *, steps_kept="all", modules_at=(),
                 stated: dict | None = None, runner: str = "paddle_loop", implementation: str = "",
                 knobs: dict | None = None, adapters: list | None = None, versions: dict | None = None):
        rank, world = self._rank_and_world()
        if world > 1:
            raise AttachError(f"PaddleStepRecorder on {world} ranks (this is rank {rank}): it records a one-rank "
                              "loop only (several ranks are not built: docs/attach.md)")
        self.model, self.optimizer, self.masters = model, optimizer, {}
        self.device_type = "cpu" if paddle.get_device() == "cpu" else "gpu"
        first = next(iter(model.parameters()))
        self._common(folder, model_config, type(optimizer), str(first.dtype).removeprefix("paddle."), steps_kept,
                     stated, runner, implementation, knobs, adapters, versions)
        trained = _trained(optimizer)
        refused = paddle_optimizer.refusals(optimizer, trained, self.stated)
        if refused:
            raise AttachError(f"{'; '.join(refused)}: the {self.record_of.name} record (harness.optimizers) does not "
                              "describe it, so the recorded run would be compared as if it had not been")
        self.states = PaddleStates(model, optimizer, self.m, self.name_map, self.record_of, self.map_described())
        self.carried = tuple(q for q in carried_quantities(self.record_of) if q != "master")
        low = paddle_optimizer.low_precision(trained)
        self.no_masters = (f"{len(low)} {paddle_optimizer.dtype_of(low[0])} parameters updated in place, without "
                           "fp32 masters (multi_precision off)") if low else None
        self.modules = ModuleSteps(model, self.m, modules_at, self._step_now, self.own, self.stack,
                                   self._module_names()) if modules_at else None
        self.zero_grads: dict[str, list[str]] = {}  # "step k" -> canonical names without a gradient at step k
        self.without: list[str] = []  # this step's parameters without a gradient, read by grads()

    def _rank_and_world(self) -> tuple[int, int]:
        if paddle.distributed.is_initialized():
            return paddle.distributed.get_rank(), paddle.distributed.get_world_size()
        return 0, 1

    def _module_names(self) -> list[str]:
        return [name for name, _ in self.model.named_sublayers()]

    def _name_section(self) -> str:
        """PaddleFleet's GPTModel (what PaddleFormers' fleet builders return, marked ``is_fleet``) has its own section
        (``[paddlefleet]``); every other model the dygraph one."""
        return FLEET if getattr(self.model, "is_fleet", False) is True else self.stack

    def _writes(self):
        return _save, lambda a: np.ascontiguousarray(a).view(np.uint8)

    def _digest_on_device(self) -> bool:
        """The host's XXH3, on any device (Paddle's bits128v1, harness.runners.paddle.digest, is not wired in here)."""
        return False

    def _versions(self) -> dict:
        return {"paddlepaddle": paddle.__version__, "paddle_commit": paddle.version.commit}

    def _provenance(self) -> dict:
        flags = paddle.get_flags(["FLAGS_use_accuracy_compatible_kernel"])
        return {"framework": "paddle", "device": self.device_type, "paddle_flags": flags}

    def grads(self) -> dict[str, np.ndarray]:
        """The gradients the optimizer is about to consume (canonical host copies): before ``optimizer.step()``.
        A gradient Paddle has not made (``param.grad`` None) is read as zeros and left None. An error stops the
        recording, not the training (the base class's ``guard``)."""
        return self.guard(self._grads) or {}

    def _grads(self) -> dict[str, np.ndarray]:
        self.without = self.states.without_gradient()
        return {f"grad.{name}": value.copy() for name, value in self.states.canonical("grad").items()}

    def record(self, step: int, losses, lr: float, grads: dict, grad_norm=None, clip_coeff=None) -> None:
        """Step `step`'s file, after ``optimizer.step()``: `losses` each micro-batch's share of the step's loss,
        `lr` the lr the step used, `grads` from ``grads()``, `grad_norm` / `clip_coeff` what the clip computed."""
        self.guard(lambda: self._record(step, losses, lr, grads, grad_norm, clip_coeff), step)

    def _record(self, step: int, losses, lr: float, grads: dict, grad_norm, clip_coeff) -> None:
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
        if self.modules is not None and step in self.modules.steps:
            module_file(self.folder, step).parent.mkdir(exist_ok=True)
            _save(self.modules.take(), str(module_file(self.folder, step)), self.modules.metadata())
        if self.without:
            self.zero_grads[f"step {step}"], self.without = self.without, []
        self.steps.append({"step": step, "lr": float(lr)})
        self.write_meta()

    def _load(self, folder, step: int) -> None:
        """paddle_model's runner's own re-feed load (``Trainer.load_state``: the inverse of each ``[paddle.grads]``
        rule into the parameters and the optimizer's accumulators), bound to this loop's model and optimizer: what it
        reads beside them, the carried quantities and where the lr goes, set here."""
        self.states.carried, self.states.scheduler = self.carried, _LearningRate(self.optimizer)
        RunnerTrainer.load_state(self.states, {"from": str(folder)}, step)

    def _meta_notes(self) -> dict:
        notes = {"zero_grads": self.zero_grads}
        if self.no_masters:
            notes["no_masters"] = self.no_masters
        return notes

    def _optimizer_fields(self) -> dict:
        optimizer, params = self.optimizer, list(self.states.params.values())
        exempt = {p.name for p in params if paddle_optimizer.undecayed(optimizer, p)}
        shown = ("all" if not exempt else
                 "not_1d" if exempt == {p.name for p in params if len(p.shape) <= 1} else "default")
        lr = optimizer._learning_rate
        base = float(getattr(lr, "base_lr", lr)) if not isinstance(lr, (int, float)) else float(lr)
        fields = {"lr": base, "weight_decay": paddle_optimizer.weight_decay(optimizer), "weight_decay_params": shown}
        if self.record_of.name == "adamw":
            return {**fields, "betas": [float(optimizer._beta1), float(optimizer._beta2)],
                    "eps": float(optimizer._epsilon), "torch_adamw": "default"}
        return {**fields, "optimizer": "sgd", "momentum": float(optimizer._momentum)}

    def _has_masters(self) -> bool:
        return False


def single_names(named, model) -> dict:
    """{name: tensor} of `named` (a model's named_parameters() or named_buffers()): a PaddleFleet GPTModel's (a
    pipeline layer, whose own names are "{index}.<sublayer>") under the single-model names its state_dict() gives
    (``GPTModel._set_pipeline_name_mapping``, gpt_model.py @ 509f514; it fills ``_pp_to_single_mapping``); any other
    model's as they are. Reads names only: the tensors are the model's own."""
    if getattr(model, "_pp_to_single_mapping", None) is None and hasattr(model, "_set_pipeline_name_mapping"):
        model._set_pipeline_name_mapping()
    mapping = getattr(model, "_pp_to_single_mapping", None) or {}
    return {mapping.get(name, name): tensor for name, tensor in named}


def _trained(optimizer) -> list:
    """The parameters `optimizer` updates (its parameter list, or its param groups' ``params``), but frozen ones."""
    params = []
    for entry in optimizer._parameter_list or []:
        params += entry["params"] if isinstance(entry, dict) else [entry]
    return [p for p in params if not p.stop_gradient]


class _LearningRate:
    """Where a loop's optimizer takes its lr from, as the runner's load sets it (``scheduler.last_lr = lr``): the
    loop's ``LRScheduler`` (PaddleFormers' Trainer's), or a fixed lr through ``optimizer.set_lr``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def last_lr(self) -> float:
        return self.optimizer.get_lr()

    @last_lr.setter
    def last_lr(self, lr: float) -> None:
        scheduler = self.optimizer._learning_rate
        if isinstance(scheduler, paddle.optimizer.lr.LRScheduler):
            scheduler.last_lr = lr
        else:
            self.optimizer.set_lr(lr)
