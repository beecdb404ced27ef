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
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from harness.case.ops import carried_quantities, step_quantities
from harness.case.train_settings import FIELDS, TrainSettings
from harness.families import model_config
from harness.families.names import NameMap
from harness.optimizers import OPTIMIZERS
from harness.run.protocol import META, env_flags, host_provenance
from harness.run.steps import CAPTURE, StepWriter, state_locations
from harness.runners.torch import env as torch_env
from harness.runners.torch.train_state import TorchStates, host_bytes, save_on_host

# optimizer class (torch.optim's; paddle.optimizer's) -> the optimizer record (harness.optimizers) whose state it keeps
TORCH_OPTIMIZERS = {"AdamW": "adamw", "SGD": "sgd", "Momentum": "sgd"}
# what a caller may state about its loop that the optimizer does not show (TrainSettings' fields)
STATED = ("lr", "min_lr", "warmup_steps", "decay_style", "decay_steps", "clip_grad", "weight_decay_params",
          "expert_bias_update")


class _Every:
    """Every step (steps_kept "all" of a loop whose number of steps is not known ahead)."""

    def __contains__(self, step) -> bool:
        return True


EVERY = _Every()


class AttachError(ValueError):
    """A loop the recorder cannot capture as it is; the message names what and the value."""


class StepRecorder:
    """Writes `folder`/steps/step{k:05d}.safetensors and `folder`/meta.json for a torch loop.

    `model`: the HF model (its parameter and buffer names are the family's HF names); `model_config`: its config in
    the harness's form (``{"family": ..., <the family's HF config keys>}``, as a training case's ``config.model``);
    `optimizer`: the torch optimizer whose state is written (AdamW, or SGD with momentum); `masters`: {HF parameter
    name: fp32 master} where the loop keeps them; `steps_kept`: "all", "none" or a list of steps (the others keep
    their scalars and one digest per tensor); `stated`: what only the loop knows (``STATED``: its schedule, its
    clipping), for the description; `runner`: who trained (``hf_trainer``, ``torch_loop``...); `implementation`,
    `knobs`, `adapters`, `versions`: into meta.json as a runner's."""

    stack = "hf"  # the name map's section its state is read through, and meta.json's state locations

    def __init__(self, folder, model, optimizer, model_config: dict, *, dtype: str | None = None,
                 masters: dict | None = None, steps_kept="all", stated: dict | None = None, runner: str = "torch_loop",
                 implementation: str = "", knobs: dict | None = None, adapters: list | None = None,
                 versions: dict | None = None):
        self.model, self.optimizer, self.masters = model, optimizer, masters or {}
        first = next(iter(model.parameters()))
        self.device = first.device
        self._common(folder, model_config, type(optimizer), dtype or str(first.dtype).removeprefix("torch."),
                     steps_kept, stated, runner, implementation, knobs, adapters, versions)
        self.states = TorchStates.hf(model, self.m, NameMap.load(self.family, "hf"), optimizer,
                                     carried_quantities(self.record_of), self.masters)

    def _common(self, folder, model_config, optimizer_class, dtype: str, steps_kept, stated, runner,
                implementation, knobs, adapters, versions) -> None:
        """What every recorder sets up: the model's config, the optimizer's record, the steps kept, the writer."""
        self.folder, self.runner = Path(folder), runner
        self.m = _model(model_config)
        self.family = self.m.family
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
        self.kept_setting = steps_kept
        self.kept = EVERY if steps_kept == "all" else set() if steps_kept == "none" else set(steps_kept)
        rank, self.world = self._rank_and_world()
        self.writer = StepWriter(self.folder, [], *self._writes(), rank)
        self.writer.kept = self.kept if rank == 0 else set()  # "all" of an unknown number of steps
        self.rank, self.steps, self.micro_batches, self.has_clip = rank, [], None, False
        self.implementation, self.knobs, self.adapters = implementation, knobs or {}, adapters or []
        self.versions = {**self._versions(), **(versions or {})}

    # --- what differs by framework (torch here; harness.attach.paddle overrides) --------------------------------
    def _rank_and_world(self) -> tuple[int, int]:
        if torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _writes(self):
        """StepWriter's `save` and `raw_bytes`: the framework's."""
        return save_on_host, host_bytes

    def _versions(self) -> dict:
        return {"torch": torch.__version__}

    def _provenance(self) -> dict:
        """What meta.json says of the framework, the device and its flags (read, never set: the loop's own)."""
        return {"framework": "pytorch", "device": self.device.type,
                "determinism": {**torch_env._precision_flags(),
                                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                                "cudnn_deterministic": torch.backends.cudnn.deterministic},
                **torch_env.provenance(self.device)}

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

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the optimizer is about to consume, canonical and copied: call after the last micro-batch's
        backward, before clipping (it scales them in place)."""
        return self.states.grads()

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
        """Step `step`'s file, after ``optimizer.step()``: `losses` each micro-batch's loss as backpropagated,
        `lr` the lr the step used, `grads` from ``grads()``, `grad_norm` / `clip_coeff` the norm and the factor the
        loop's clipping computed and applied (None where it computes none)."""
        losses = self._check(step, losses)
        loss_dtype = torch.float64 if self.dtype == "float64" else torch.float32
        scalars = {"lr": torch.tensor(float(lr), dtype=torch.float64),
                   "loss": torch.stack([loss.detach().reshape(()) for loss in losses]).to(loss_dtype)}
        for name, value in (("grad_norm", grad_norm), ("clip_coeff", clip_coeff)):
            if value is not None:  # the gradients' dtype, as the runner writes them
                scalars[name] = torch.as_tensor(value).detach().reshape(())
        self.has_clip = self.has_clip or clip_coeff is not None
        self.writer.write(step, scalars, self.states.step_outputs(grads))
        self.steps.append({"step": step, "lr": float(lr)})
        self.write_meta()

    def describe(self) -> dict:
        """The training settings this run amounts to (``TrainSettings.to_dict``): the optimizer's from its param
        groups, the rest stated by the caller or read from the steps written."""
        settings = {**self._optimizer_fields(),
                    "steps": len(self.steps), "micro_batches": (self.micro_batches or 1) * self._layout()["dp"],
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
        exempt = [p for g in groups if g.get("weight_decay", 0.0) == 0 for p in g["params"]]
        one_d = [p for g in groups for p in g["params"] if p.dim() <= 1]
        shown = ("all" if len(set(decays)) == 1 else
                 "not_1d" if {id(p) for p in exempt} == {id(p) for p in one_d} else "default")
        return {**self._optimizer_settings(groups[0]), "lr": max(g.get("initial_lr", g["lr"]) for g in groups),
                "weight_decay": float(max(decays)), "weight_decay_params": shown}

    def _optimizer_settings(self, group: dict) -> dict:
        if self.record_of.name == "adamw":
            flags = ("fused" if group.get("fused") else "foreach" if group.get("foreach") else
                     "for_loop" if group.get("foreach") is False else "default")
            return {"betas": [float(b) for b in group["betas"]], "eps": float(group["eps"]), "torch_adamw": flags}
        if self.record_of.name == "sgd":
            if group.get("nesterov") or group.get("dampening", 0):
                raise AttachError(f"torch.optim.SGD with nesterov={group.get('nesterov')}, dampening="
                                  f"{group.get('dampening')}: the sgd record is momentum without either")
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
                else sorted(self.kept_setting),
                "state_locations": state_locations(self.family, self.stack, self.record_of,
                                                   step_quantities(self.record_of)),
                **provenance, **self._meta_notes(),
                CAPTURE: {"dtype": self.dtype, "device": provenance["device"], "tokens": None,
                          "config": {"model": self.m.to_dict(), "train": self.describe()},
                          "steps": self.steps}}
        path = self.folder / META
        path.with_suffix(".tmp").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        os.replace(path.with_suffix(".tmp"), path)


def _model(config):
    try:
        return model_config(config)
    except (ValueError, KeyError, TypeError) as error:
        raise AttachError(f"model_config: {error}") from None

