"""``StepRecorder``: any torch training loop over an HF-named model, captured step by step in the built-in runners'
step files (docs/attach.md).

The user's loop calls ``grads()`` where its gradients are whole and not yet clipped (after the last micro-batch's
backward), then ``record(step, losses, lr, grads, ...)`` after ``optimizer.step()``. What is written, and how it is
read, is hf_model's training runner's (``harness.runners.torch.hf_train``): ``TorchStates.hf`` (each canonical
parameter through the family's ``[hf.grads]`` rule), ``grads()`` and ``step_outputs()`` for the state, the same
scalars in the same dtypes, ``StepWriter`` with the same ``save_on_host`` / ``host_bytes``. ``meta.json`` holds what a
runner's holds (versions, device, determinism flags, environment flags, state locations, knobs) and, under
``capture``, the request's fields a comparison reads (``harness.run.steps.CAPTURE``): the model's config, the dtype,
and the training settings as far as the loop shows them (the optimizer's own from its param groups; what the loop
alone knows, its schedule, from the caller).

A recorder changes nothing in the loop it records, refuses at construction what its record could not describe
(``_refuse_what_it_cannot_describe``), and never stops the loop: an error while recording stops the recording only,
with a note in meta.json (``guard``, ``_stop``).

Where it digests (issue 43): a step it does not keep is written as one digest per tensor, made where the tensor lives
(``_digests``): on a GPU ``bits128v1`` on the GPU, as the built-in runners there (16 bytes a tensor come to the host,
never the tensor), on the CPU the host's XXH3 as the runners on the CPU (both runs of a comparison digest alike);
``digest_on_device=True`` takes the GPU's code path on the CPU too. On such a step the gradients are digested when the
loop hands them over (before clipping changes them in place) instead of copied (``grads``): a full-width step's copy
of every gradient is as large as the gradients. What it keeps by default (``steps_kept="auto"``): every step where a
step's state is small (``KEEP_ALL_BYTES``), else none.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from harness.attach.modules import ModuleSteps
from harness.capture import module_file
from harness.case.ops import carried_quantities, step_quantities
from harness.case.train_settings import FIELDS, TrainSettings
from harness.families import DEFAULT, ModelConfigError, model_config
from harness.families.names import NameMap
from harness.families.own import OWN, SECTIONS, OwnNames
from harness.optimizers import OPTIMIZERS
from harness.run.protocol import META, env_flags, host_provenance
from harness.run.steps import CAPTURE, STATE_ABOUT, StepWriter, state_about, state_locations, step_file
from harness.runners.torch import env as torch_env
from harness.runners.torch import ranks
from harness.runners.torch.train_state import TorchStates, digests_used, host_bytes, save_on_host

# optimizer class (torch.optim's; paddle.optimizer's) -> the optimizer record (harness.optimizers) whose state it keeps
TORCH_OPTIMIZERS = {"AdamW": "adamw", "SGD": "sgd", "Momentum": "sgd"}
# what a caller may state about its loop that the optimizer does not show (TrainSettings' fields)
STATED = ("lr", "min_lr", "warmup_steps", "decay_style", "decay_steps", "clip_grad", "weight_decay_params",
          "expert_bias_update")
# steps_kept="auto" keeps every step while a step's state (the optimizer's tensors times the quantities a step writes
# of each) is at most this; above it, none: a full-width Kimi-K2 step is 79 GB, which would fill a disk in a few steps
KEEP_ALL_BYTES = 4 << 30


class _Every:
    """Every step (steps_kept "all" of a loop whose number of steps is not known ahead)."""

    def __contains__(self, step) -> bool:
        return True


EVERY = _Every()
log = logging.getLogger(__name__)
# optimizer flags the optimizer records describe as their math: a loop that sets one is refused
REFUSED_FLAGS = {"adamw": {"amsgrad": False, "maximize": False}, "sgd": {"maximize": False, "nesterov": False,
                                                                         "dampening": 0}}
# flags that keep the record's math in another code path (its bits may differ, as foreach's and fused's do): listed
LISTED_FLAGS = ("capturable", "differentiable")


class AttachError(ValueError):
    """A loop the recorder cannot capture as it is; the message names what and the value."""


# a Trainer's lr_scheduler_type (HF's, PaddleFormers' SchedulerType values) -> its decay style (TrainSettings'):
# one with another shape (linear, polynomial, restarts ...) has no description and is refused
SCHEDULES = {"cosine": "cosine", "cosine_with_min_lr": "cosine", "constant": "constant",
             "constant_with_warmup": "constant"}


def decay_style(scheduler) -> str:
    """The decay style of a Trainer's `scheduler` (an enum or its string), or AttachError naming it: its str() is
    ``SchedulerType.COSINE``, never "cosine", so the value is read, not the text."""
    name = str(getattr(scheduler, "value", scheduler))
    if name not in SCHEDULES:
        raise AttachError(f"lr_scheduler_type {name!r}: the training settings describe {', '.join(SCHEDULES)} "
                          "(harness.case.train_settings' decay styles); a run of another schedule would be compared "
                          "as if it had not been")
    return SCHEDULES[name]


def state_step(folder) -> int:
    """The step a state folder holds the state after (``python -m harness state-for``'s state.json; checked in full
    when a recorder loads it): a Trainer callback's ``state_from`` loads it at the beginning of the step after."""
    try:
        return int(json.loads((Path(folder) / STATE_ABOUT).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AttachError(f"state_from={str(folder)!r}: {Path(folder) / STATE_ABOUT} unreadable ({error})") from None


def never_loaded(folder, steps: int) -> None:
    """A Trainer that ended before the step its ``state_from`` was for: the recording stops (``guard``), so that
    compare-runs refuses the run rather than take it for a re-fed one."""
    raise AttachError(f"state_from={str(folder)!r}: training ended after {steps} steps, before the step it was for")


class StepRecorder:
    """Writes `folder`/steps/step{k:05d}.safetensors and `folder`/meta.json for a torch loop.

    `model`: the HF model (its parameter and buffer names are the family's HF names); `model_config`: its config in
    the harness's form (``{"family": ..., <the family's HF config keys>}``, as a training case's ``config.model``);
    `optimizer`: the torch optimizer whose state is written (AdamW, or SGD with momentum); `masters`: {HF parameter
    name: fp32 master} where the loop keeps them; `steps_kept`: "all", "none", a list of steps (the others keep
    their scalars and one digest per tensor) or "auto" ("all" where a step's state is at most KEEP_ALL_BYTES, else
    "none"); `digest_on_device`: digest where the tensors are with bits128v1 (None: on a GPU, as the runners);
    `modules_at`: steps at which every module's output of each micro-batch
    and its output gradient are written too, in canonical names (``harness.attach.modules``); `stated`: what only the
    loop knows (``STATED``: its schedule, its clipping), for the description; `runner`: who trained (``hf_trainer``,
    ``torch_loop``...); `implementation`, `knobs`, `adapters`, `versions`: into meta.json as a runner's."""

    stack = "hf"  # the name map's section its state is read through, and meta.json's state locations

    def __init__(self, folder, model, optimizer, model_config: dict, *, dtype: str | None = None,
                 masters: dict | None = None, steps_kept="auto", modules_at=(), stated: dict | None = None,
                 runner: str = "torch_loop", implementation: str = "", knobs: dict | None = None,
                 adapters: list | None = None, versions: dict | None = None, digest_on_device: bool | None = None):
        self.model, self.optimizer, self.masters = model, optimizer, masters or {}
        first = next(iter(model.parameters()))
        self.device, self.digest_on_device = first.device, digest_on_device
        self._common(folder, model_config, type(optimizer), dtype or str(first.dtype).removeprefix("torch."),
                     steps_kept, stated, runner, implementation, knobs, adapters, versions)
        self.states = TorchStates.hf(model, self.m, self.name_map, optimizer,
                                     carried_quantities(self.record_of), self.masters, fill_absent_grads=False)
        self.group = ranks.gather_group()  # every rank's losses, in global micro-batch order
        self._refuse_what_it_cannot_describe()
        self.modules = ModuleSteps(model, self.m, modules_at, self._step_now, self.own, self.stack,
                                   self._module_names()) if modules_at and self.rank == 0 else None

    def _common(self, folder, model_config, optimizer_class, dtype: str, steps_kept, stated, runner,
                implementation, knobs, adapters, versions) -> None:
        """What every recorder sets up: the model's config, the optimizer's record, the steps kept, the writer."""
        self.folder, self.runner = Path(folder), runner
        self.m, self.own = self._model_and_names(model_config)
        self.family = self.m.family
        self.name_map = self.own.name_map() if self.own else NameMap.load(self.family, self._name_section(),
                                                                          model=self.m)
        name = TORCH_OPTIMIZERS.get(optimizer_class.__name__)
        if name is None:
            raise AttachError(f"optimizer {optimizer_class.__module__}.{optimizer_class.__name__}: the recorder "
                              f"writes the state of {', '.join(TORCH_OPTIMIZERS)} (harness.optimizers)")
        self.record_of = OPTIMIZERS[name]
        self.dtype = dtype
        unknown = sorted(set(stated or {}) - set(STATED))
        if unknown:
            raise AttachError(f"stated: {', '.join(unknown)} not among {', '.join(STATED)}")
        self.stated = dict(stated or {})
        if steps_kept == "last":
            raise AttachError("steps_kept='last': the recorder does not know the last step ahead; give the steps")
        if steps_kept == "auto":
            steps_kept = "all" if self._state_bytes() <= KEEP_ALL_BYTES else "none"
        self.kept_setting = steps_kept
        self.kept = EVERY if steps_kept == "all" else set() if steps_kept == "none" else set(steps_kept)
        rank, self.world = self._rank_and_world()
        digests, self.digests_used = self._digests()
        self.writer = StepWriter(self.folder, [], *self._writes(), rank, digests=digests)
        self.writer.kept = self.kept if rank == 0 else set()  # "all" of an unknown number of steps
        self.rank, self.steps, self.micro_batches, self.has_clip = rank, [], None, False
        self.modules: ModuleSteps | None = None  # modules_at's hooks (the torch recorder's)
        self.stopped: dict | None = None  # {"step", "error"} once an error stopped the recording
        self.refed: dict | None = None  # {"from", "step", "state"} once another run's state was loaded
        self.listed: dict = {}  # optimizer flags meta.json lists (``_refuse_what_it_cannot_describe``)
        self.implementation, self.knobs, self.adapters = implementation, knobs or {}, adapters or []
        self.versions = {**self._versions(), **(versions or {})}

    def _model_and_names(self, config) -> tuple:
        """(the model's config, None), or for a model without a family record (``{"family": "own"}``, optionally
        with ``"name_map": FILE``) its canonical parameters and its names (``harness.families.own``)."""
        if not (isinstance(config, dict) and config.get("family") == OWN):
            return _model(config), None
        if self.stack not in SECTIONS:
            raise AttachError(f"model_config family {OWN!r}: a model of its own is recorded by the torch and Paddle "
                              f"recorders ({type(self).__name__} reads its family's [{self.stack}] name map)")
        unknown = sorted(set(config) - {"family", "name_map"})
        if unknown:
            raise AttachError(f"model_config: unknown key {unknown[0]!r} of a model of its own (known: family, "
                              "name_map)")
        parameters = {name: tuple(int(d) for d in p.shape) for name, p in self.model.named_parameters()}
        try:
            names = OwnNames.read(config.get("name_map"), self.stack, parameters, self._module_names())
        except ModelConfigError as error:
            raise AttachError(str(error)) from None
        return names.canonical(parameters), names

    # --- what differs by framework (torch here; harness.attach.paddle overrides) --------------------------------
    def _name_section(self) -> str:
        """The family's name-map section the model's names are read through."""
        return self.stack

    def _module_names(self) -> list[str]:
        return [name for name, _ in self.model.named_modules() if name]

    def _rank_and_world(self) -> tuple[int, int]:
        if torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _writes(self):
        """StepWriter's `save` and `raw_bytes`: the framework's."""
        return save_on_host, host_bytes

    def _digests(self):
        """StepWriter's `digests` and what meta.json calls them: bits128v1 where the tensors are (on a GPU, or asked
        for), else None (the host's XXH3 of `raw_bytes`)."""
        if not self._digest_on_device():
            return None, digests_used(torch.device("cpu"))
        from harness.runners.torch.digest import digests, implementation

        digests([torch.zeros(1, dtype=torch.int64, device=self.device)])  # the kernel's build and load: here, once
        return digests, implementation(self.device)

    def _digest_on_device(self) -> bool:
        return self.device.type != "cpu" if self.digest_on_device is None else self.digest_on_device

    def _digests_early(self) -> bool:
        """Whether this step's gradients are digested when handed over, not copied: a step not kept, digested where
        the tensors are."""
        return self.writer.digests is not None and self._step_now() not in self.writer.kept

    def _state_bytes(self) -> int:
        """About a step's state: the optimizer's tensors, each written as every quantity a step holds."""
        held = sum(p.numel() * p.element_size() for group in self._groups() for p in group["params"])
        return held * len(step_quantities(self.record_of))

    def _versions(self) -> dict:
        return {"torch": torch.__version__}

    def _provenance(self) -> dict:
        """What meta.json says of the framework, the device and its flags (read, never set: the loop's own)."""
        return {"framework": "pytorch", "device": self.device.type,
                "determinism": {**torch_env._precision_flags(),
                                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                                "cudnn_deterministic": torch.backends.cudnn.deterministic},
                **torch_env.provenance(self.device)}

    # --- what a recorder refuses at construction (each a method a subclass may override) -------------------------
    def _refuse_what_it_cannot_describe(self) -> None:
        """AttachError, before the loop trains, for a run whose record would be refused or would say less than it
        trained: masters where the dtype takes none (or none where it does), an optimizer flag outside the record's
        math, a trained parameter no name-map rule reads. What stays comparable is listed in meta.json
        (``capture.not_described``)."""
        self._check_masters()
        self._optimizer_fields()  # the optimizer's settings as the record has them, or AttachError
        self.listed = {flag: value for group in self._groups() for flag, value in self._listed_flags(group).items()}
        unread = self._unread_parameters()
        if unread:
            raise AttachError(f"trained parameters {', '.join(unread[:5])}{' ...' if len(unread) > 5 else ''} "
                              f"({len(unread)}): in the optimizer's param groups, read by no rule of "
                              f"{self.map_described()}: their training would not be recorded; name them in the "
                              "map, train them in another optimizer, or record a model the map describes")

    def map_described(self) -> str:
        """The name map the state is read through, for a message: the family's section, or the user's file."""
        if self.own is None:
            return f"the {self.family} name map ([{self._name_section()}] section)"
        if self.own.path is None:
            return "the model's own names (no name map given)"
        return f"the name map {self.own.path} ([{SECTIONS[self.stack]}.grads])"

    def _check_masters(self) -> None:
        """A bfloat16 loop trains fp32 masters and any other dtype none (what a training case's settings allow)."""
        masters = self._has_masters()
        if self.dtype == "bfloat16" and not masters:
            raise AttachError("dtype bfloat16 without fp32 master weights: the records compare a bfloat16 run by "
                              "its fp32 masters; pass masters={HF parameter name: its fp32 master} (the tensors "
                              "your optimizer steps)")
        if self.dtype != "bfloat16" and masters:
            raise AttachError(f"dtype {self.dtype} with master weights: only a bfloat16 run keeps fp32 masters "
                              "(pass masters=None)")

    def _unread_parameters(self) -> list[str]:
        """The optimizer's tensors no name-map rule reads (as parameter or master), by name where the model names
        them."""
        states = self.states
        read = {id(states.masters.get(s, states.params[s])) for rule in states.rules.values() for s in rule.sources}
        names = {id(t): n for n, t in {**states.params, **states.masters}.items()}
        return [names.get(id(p), f"an unnamed {list(p.shape)} tensor") for g in self._groups() for p in g["params"]
                if id(p) not in read]

    def _listed_flags(self, group: dict) -> dict:
        """The optimizer's flags set in `group` that the record's fields do not carry but the comparison survives."""
        return {flag: group[flag] for flag in LISTED_FLAGS if group.get(flag)}

    # --- an error while recording stops the recording, never the loop ---------------------------------------------
    def guard(self, action, step: int | None = None, collective: bool = False):
        """`action()`'s value; after an error (now or earlier) None, the recording stopped (``_stop``). A
        `collective` action runs on a stopped rank too: the other ranks wait for it."""
        if self.stopped is not None and not collective:
            return None
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - any error of the recorder: the user's training goes on
            if self.stopped is None:
                self._stop(len(self.steps) + 1 if step is None else step, error)
            return None

    def _stop(self, step: int, error: Exception) -> None:
        """No more steps are recorded; meta.json says at which step (the one the failing call named) and why, and
        describes the run as one step longer than it recorded, that step's file absent (removed where it was written,
        whole or in part), so that compare-runs refuses it (ERROR) rather than passes the steps before."""
        self.stopped = {"step": step, "error": f"{type(error).__name__}: {error}"}
        log.warning("harness recorder (%s): recording stopped at step %d (%s); training goes on unrecorded, "
                    "%s says so", self.folder, step, self.stopped["error"], self.folder / META)
        try:
            step_file(self.folder, len(self.steps) + 1, self.rank).unlink(missing_ok=True)
        except OSError:  # the steps folder itself gone (a disk that went away): no file to remove
            pass
        try:
            self.write_meta()
        except Exception as again:  # noqa: BLE001 - the folder itself failing: the warning is all there is
            log.warning("harness recorder (%s): meta.json not written either (%s: %s)", self.folder,
                        type(again).__name__, again)

    def _check(self, step: int, losses) -> list:
        """`losses` as a list, once the step is the next one and has step 1's number of micro-batches."""
        expected = len(self.steps) + 1
        if step != expected:
            raise AttachError(f"step {step} recorded after {len(self.steps)} steps: record every step, in order "
                              f"(expected {expected})")
        losses = list(losses)
        if self.micro_batches is None:
            self.micro_batches = len(losses)
        elif len(losses) != self.micro_batches:
            raise AttachError(f"step {step} has {len(losses)} micro-batch losses, step 1 had {self.micro_batches}")
        return losses

    def _groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _layout(self) -> dict:
        """The run's ranks as the training settings name them: every rank data parallel (``record`` is handed this
        rank's micro-batches' losses, so the global micro-batches are those x dp)."""
        return {"dp": self.world, "ep": 1, "distributed_optimizer": False}

    def _has_masters(self) -> bool:
        return bool(self.masters)

    def _meta_notes(self) -> dict:
        """What a recorder adds to meta.json beside a runner's keys (the Paddle recorder's; none here)."""
        return {}

    def _step_now(self) -> int | None:
        """The step the loop is in (None once the recording stopped: modules_at captures nothing more)."""
        return None if self.stopped is not None else len(self.steps) + 1

    def close(self) -> None:
        """Remove the hooks of `modules_at` (none without it)."""
        if self.modules is not None:
            self.modules.close()

    def load_state(self, folder) -> None:
        """Start the next step from another run's state (a folder ``python -m harness state-for RUN_A --step k --as
        THIS_RUN`` wrote): call after step k's ``record`` and the scheduler's step, before step k + 1's forward.
        Run A's parameters, masters, optimizer state and routing biases go into this loop's own tensors through its
        name map, and run A's lr of step k + 1 into its param groups: the built-in re-feed in time's ``load_state``.
        The step counters stay this loop's own (it made k steps too). AttachError, before anything is loaded, for a
        state of another model, dtype, optimizer or masters setting, or of another step; meta.json then says the run
        was re-fed (``capture.refed``), which ``compare-runs --refed`` reads."""
        try:
            said = state_about(folder, self.m.to_dict(), self.record_of.name, self.dtype, self._has_masters())
        except ValueError as error:
            raise AttachError(str(error)) from None
        if self.stopped is not None or self.refed is not None or len(self.steps) != said["step"]:
            why = ("the recording stopped" if self.stopped is not None else "a state was loaded already"
                   if self.refed is not None else f"{len(self.steps)} steps were recorded")
            raise AttachError(f"{folder}: the state after step {said['step']} is loaded after step {said['step']}'s "
                              f"record, once; {why}")
        self._load(folder, said["step"] + 1)
        self.refed = {"from": said["from"], "step": said["step"], "state": str(Path(folder).resolve())}

    def _load(self, folder, step: int) -> None:
        """The built-in runners' re-feed load of the state before `step` and its lr, through this loop's states."""
        from harness.runners.torch.train_state import load_state

        load_state(self.states, {"from": str(folder)}, step, self._set_lr)

    def _set_lr(self, lr: float) -> None:
        for group in self._groups():
            group["lr"] = lr

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the optimizer is about to consume, canonical and copied (on a step not kept and digested on
        the device: digested, ``Digested``, not copied): call after the last micro-batch's backward, before clipping
        (it scales them in place), and hand the result to ``record``. A parameter without a gradient reads as zeros
        (its ``.grad`` left None) and is named in meta.json (``capture.steps[k].without_grad``)."""
        return self.guard(self._grads) or {}

    def _grads(self) -> dict:
        return self.states.digest_grads() if self._digests_early() else self.states.grads()

    def clip_grad_norm_(self, parameters, max_norm: float):
        """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` as the loop would call it, returning (norm, the
        factor it multiplied the gradients by) for ``record``: the factor seen by hf_model's runner's own observer
        (``ClipFactor``: the output of its one ``torch.clamp``)."""
        from harness.runners.torch.hf_train import ClipFactor

        observer = ClipFactor()
        with observer:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm, observer.factor()

    def record(self, step: int, losses, lr: float, grads: dict[str, torch.Tensor], grad_norm=None,
               clip_coeff=None) -> None:
        """Step `step`'s file, after ``optimizer.step()``: `losses` each micro-batch's loss as backpropagated (this
        rank's), `lr` the lr the step used, `grads` from ``grads()``, `grad_norm` / `clip_coeff` the norm and the
        factor the loop's clipping computed and applied (None where it computes none). Returns, whatever happens
        (``guard``)."""
        every = None if self.group is None else self.guard(lambda: self._global_losses(losses), step, True)
        self.guard(lambda: self._record(step, losses, every, lr, grads, grad_norm, clip_coeff), step)

    def _global_losses(self, losses) -> torch.Tensor:
        """Every rank's micro-batch losses in global order, each its share of the step's loss (hf_model's runner's
        ``ranks.global_losses``). A collective: every rank calls it every step, stopped or not."""
        local = torch.stack([loss.detach().reshape(()) for loss in losses])
        return ranks.global_losses(local, self.world, self.group)

    def _record(self, step: int, losses, every, lr: float, grads: dict, grad_norm, clip_coeff) -> None:
        """`losses` this rank's, `every` all ranks' in global order (None on one rank)."""
        losses = self._check(step, losses)
        if every is None:
            every = torch.stack([loss.detach().reshape(()) for loss in losses])
        loss_dtype = torch.float64 if self.dtype == "float64" else torch.float32
        scalars = {"lr": torch.tensor(float(lr), dtype=torch.float64), "loss": every.to(loss_dtype)}
        for name, value in (("grad_norm", grad_norm), ("clip_coeff", clip_coeff)):
            if value is not None:  # the gradients' dtype, as the runner writes them
                scalars[name] = torch.as_tensor(value).detach().reshape(())
        self.has_clip = self.has_clip or clip_coeff is not None
        without = sorted(self.states.absent)
        self.writer.write(step, scalars, self.states.step_outputs(grads))
        if self.modules is not None and step in self.modules.steps:
            module_file(self.folder, step).parent.mkdir(exist_ok=True)
            save_on_host(self.modules.take(), str(module_file(self.folder, step)), self.modules.metadata())
        self.steps.append({"step": step, "lr": float(lr), **({"without_grad": without} if without else {})})
        self.write_meta()

    def describe(self) -> dict:
        """The training settings this run amounts to (``TrainSettings.to_dict``): the optimizer's from its param
        groups, the rest stated by the caller or read from the steps written."""
        settings = {**self._optimizer_fields(),  # a stopped run describes the step it stopped at: its file absent
                    "steps": len(self.steps) + (self.stopped is not None),
                    "micro_batches": (self.micro_batches or 1) * self._layout()["dp"],
                    "min_lr": 0.0,
                    "warmup_steps": 0, "decay_style": "constant",
                    "decay_steps": max(1, len(self.steps)), "master_weights": self._has_masters(),
                    **self._layout(), "expert_bias_update": "default",
                    "steps_kept": sorted(s["step"] for s in self.steps if s["step"] in self.kept), "flip": None,
                    **self.stated}
        # clipped: a factor was written (its norm as stated, else 1.0); without one the run is unclipped whatever was
        # stated (compare-runs compares clip factors only where both runs wrote them)
        settings["clip_grad"] = float(self.stated.get("clip_grad") or 1.0) if self.has_clip else 0.0
        missing = [key for key in FIELDS if key not in settings]
        if missing:
            raise AttachError(f"the description lacks {', '.join(missing)}")
        return TrainSettings.from_dict(settings).to_dict()

    def _optimizer_fields(self) -> dict:
        """The optimizer's own settings, its lr and weight decay, and which parameters decay, from its groups."""
        groups = self._groups()
        decays = [g.get("weight_decay", 0.0) for g in groups]
        exempt = [p for decay, params in self._decay_groups() if decay == 0 for p in params]
        one_d = [p for _, params in self._decay_groups() for p in params if p.dim() <= 1]
        shown = ("all" if len(set(decays)) == 1 else
                 "not_1d" if {id(p) for p in exempt} == {id(p) for p in one_d} else "default")
        return {**self._optimizer_settings(groups[0]), "lr": max(g.get("initial_lr", g["lr"]) for g in groups),
                "weight_decay": float(max(decays)), "weight_decay_params": shown}

    def _decay_groups(self) -> list[tuple[float, list]]:
        """Each param group's weight decay and the parameters it steps, in the model's shapes."""
        return [(g.get("weight_decay", 0.0), g["params"]) for g in self._groups()]

    def _optimizer_settings(self, group: dict) -> dict:
        name = self.record_of.name
        changed = {flag: group.get(flag, default) for flag, default in REFUSED_FLAGS.get(name, {}).items()
                   if group.get(flag, default) != default}
        if changed:
            shown = ", ".join(f"{flag}={value}" for flag, value in changed.items())
            raise AttachError(f"{type(self.optimizer).__name__} with {shown}: the {name} record is its math without "
                              f"{' or '.join(changed)} (harness.optimizers)")
        if self.record_of.name == "adamw":
            flags = ("fused" if group.get("fused") else "foreach" if group.get("foreach") else
                     "for_loop" if group.get("foreach") is False else "default")
            return {"betas": [float(b) for b in group["betas"]], "eps": float(group["eps"]), "torch_adamw": flags}
        if self.record_of.name == "sgd":
            return {"optimizer": "sgd", "momentum": float(group["momentum"])}
        raise AttachError(f"no settings reader for {self.record_of.name}")

    def write_meta(self) -> None:
        """meta.json as a runner's, plus the description compare-runs reads; rewritten after every step (whole or
        absent), so a loop that stops early leaves a comparable run."""
        if self.rank != 0:
            return
        provenance = self._provenance()
        meta = {"runner": self.runner, "versions": self.versions,
                "implementation": self.implementation, "adapters": self.adapters, "knobs": self.knobs,
                "host": host_provenance(), "env": env_flags(),
                "python": sys.version.split()[0], "executable": sys.executable, "rank": self.rank,
                "world_size": self.world, "steps_kept": self.kept_setting if isinstance(self.kept_setting, str)
                else sorted(self.kept_setting), "step_digests": self.digests_used,
                # a model of its own is kept where any model of its stack is: the default family's table says where
                "state_locations": state_locations(DEFAULT if self.own else self.family, self.stack, self.record_of,
                                                   step_quantities(self.record_of)),
                **provenance, **self._meta_notes(),
                CAPTURE: {"dtype": self.dtype, "device": provenance["device"], "tokens": None,
                          "config": {"model": self.m.to_dict(), "train": self.describe()},
                          "steps": self.steps, **self._notes()}}
        path = self.folder / META
        path.with_suffix(".tmp").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        os.replace(path.with_suffix(".tmp"), path)


    def _notes(self) -> dict:
        """What the description leaves out but the run holds: optimizer flags listed, not refused; where an error
        stopped the recording; whose state a step started from (``load_state``)."""
        modules = {"modules_at": sorted(self.modules.steps),
                   "modules_not_captured": self.modules.not_captured} if self.modules is not None else {}
        own = {"name_map": str(self.own.path) if self.own.path else None} if self.own else {}
        return {**modules, **own, **({"not_described": {"optimizer_flags": self.listed}} if self.listed else {}),
                **({"stopped": self.stopped} if self.stopped else {}),
                **({"refed": self.refed} if self.refed else {})}


def _model(config):
    try:
        return model_config(config)
    except (ValueError, KeyError, TypeError) as error:
        raise AttachError(f"model_config: {error}") from None

