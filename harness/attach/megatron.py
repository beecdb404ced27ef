"""``MegatronStepRecorder``: a Megatron-Core training loop (model chunks and Megatron's optimizer, as Megatron-LM's
``train_step`` has them) captured step by step in the built-in runners' step files (docs/attach.md)::

    recorder = MegatronStepRecorder("runs/megatron", model_chunks, optimizer, model_config)
    for step in range(1, steps + 1):
        losses = train_step(...)                # zero_grad_buffer, forward_backward_func, optimizer.step(), ...
        recorder.record(step, losses)           # the one call after optimizer.step()

What is written and how it is read is megatron_model's training runner's (``harness.runners.megatron.train``):
``MegatronStates`` over the family's ``[megatron.parameters]`` name map (Megatron's names are canonical there; a
parameter's main param and optimizer state from the chained optimizer that owns it), ``held`` and ``step_outputs`` for
what a step writes, ``clip_scale`` for the clip factor Megatron applies. Megatron's ``optimizer.step()`` clips the
gradients in place and returns only the norm, so the recorder puts one observer on the optimizer instance (changing
nothing; ``close()`` removes it): around each ``step()`` it copies the gradients the step is handed (on a step not
kept and digested on the device: digests them there instead, ``StepRecorder._digests_early``) and the lr, and sees
the clip scale. `losses` are the step's micro-batch losses as the loop's loss function returned them (Megatron divides
them in place by the token count and the micro-batches: the losses as backpropagated once the step returns).
"""

from __future__ import annotations

from harness.attach.torch import AttachError, StepRecorder
from harness.case.ops import carried_quantities, train_state_names
from harness.families import routed_experts
from harness.runners.megatron import model as megatron_model
from harness.runners.megatron.train import (
    MegatronStates,
    clip_scale,
    expert_shard,
    held_grads,
    routed_expert_names,
    step_outputs,
)
from harness.runners.torch import ranks

RUNNER = "megatron_loop"


class MegatronStepRecorder(StepRecorder):
    """Writes `folder`'s step files and meta.json after every ``optimizer.step()`` of a Megatron-Core loop.

    `model_chunks`: Megatron-LM's list of model chunks (``DistributedDataParallel`` each; one chunk: no virtual
    pipeline); `optimizer`: what ``get_megatron_optimizer`` returned; `model_config`: the harness's form of the model's
    config (``{"family": ..., <HF config keys>}``); `stated`: what only the loop knows of its schedule (``STATED``);
    the lr, min lr and clipping are read from the optimizer's config."""

    stack = "megatron"

    def __init__(self, folder, model_chunks, optimizer, model_config: dict, *, steps_kept="auto",
                 stated: dict | None = None, runner: str = RUNNER, implementation: str = "",
                 knobs: dict | None = None, adapters: list | None = None, digest_on_device: bool | None = None):
        from megatron.core import __version__ as megatron_version
        from megatron.core import parallel_state

        chunks = list(model_chunks)
        if len(chunks) != 1:
            raise AttachError(f"{len(chunks)} model chunks: the recorder reads one (no virtual pipeline stages)")
        model = getattr(chunks[0], "module", chunks[0])  # DistributedDataParallel's module
        inner = getattr(optimizer, "chained_optimizers", [optimizer])
        config = inner[0].config
        read = {"lr": float(config.lr), "min_lr": float(config.min_lr or 0.0), "clip_grad": float(config.clip_grad)}
        self.optimizer, self.clipped = optimizer, config.clip_grad > 0
        first = next(iter(model.parameters()))
        self.device, self.digest_on_device = first.device, digest_on_device
        self._common(folder, model_config, type(inner[0].optimizer), str(first.dtype).removeprefix("torch."),
                     steps_kept, {**read, **(stated or {})}, runner,
                     implementation or f"megatron.core {type(model).__name__} trained by the user's loop with "
                                       f"{type(optimizer).__name__} (inner torch.optim."
                                       f"{type(inner[0].optimizer).__name__})",
                     knobs, adapters, {"megatron-core": megatron_version})
        self.has_clip = self.clipped
        self.dp = parallel_state.get_data_parallel_world_size()
        self.ep = ep = parallel_state.get_expert_model_parallel_world_size()
        self.distributed = bool(config.use_distributed_optimizer)
        full = megatron_model.name_map(self.m)
        names = expert_shard(full, routed_experts(self.m), ep, parallel_state.get_expert_model_parallel_rank())
        self.states = MegatronStates(names, model, optimizer, dict(train_state_names(self.m)), ranks.gather_group(),
                                     ep, carried_quantities(self.record_of), routed_expert_names(full))
        self.pending = None
        self.model = model
        self._refuse_what_it_cannot_describe()
        self._observe()

    def _observe(self) -> None:
        step = self.optimizer.step

        def observed_step(*args, **kwargs):
            # step() clips the gradients in place; a rank whose recording stopped reads nothing (held gathers: on
            # several ranks the others then wait, see docs/attach.md)
            read = self.guard(lambda: (held_grads(self.states, self._digests_early()), self.states.lr()))
            with clip_scale() as scales:
                result = step(*args, **kwargs)
            self.pending = None if read is None else (*read, result, list(scales))
            return result

        self.optimizer.step = observed_step

    def close(self) -> None:
        """Remove the observer from the optimizer (its class's ``step`` again)."""
        vars(self.optimizer).pop("step", None)

    def record(self, step: int, losses) -> None:
        """Step `step`'s file, after ``optimizer.step()``: `losses` the step's micro-batch losses (this rank's).
        Returns, whatever happens (``guard``)."""
        self.guard(lambda: self._record(step, losses), step)

    def _record(self, step: int, losses) -> None:
        losses = self._check(step, losses)
        if self.pending is None:
            raise AttachError(f"step {step}: optimizer.step() was not called since the last record")
        grads, lr, (successful, grad_norm, _), scales = self.pending
        if not successful:
            raise AttachError(f"step {step}: Megatron skipped the update (inf/nan in the gradients)")
        if len(set(scales)) > 1:
            raise AttachError(f"step {step}: chained optimizers clipped by different scales {scales}")
        dtype = next(iter(self.states.rules.values())).dtype
        self.writer.write(step, *step_outputs(self.states, losses, lr, grads, grad_norm, scales, self.clipped,
                                              self.dp, dtype))
        self.pending = None
        self.steps.append({"step": step, "lr": float(lr)})
        self.write_meta()

    def grads(self):
        raise AttachError("MegatronStepRecorder copies the gradients itself, around optimizer.step()")

    def _groups(self) -> list[dict]:
        return [group for inner in self.optimizer.chained_optimizers for group in inner.optimizer.param_groups]

    def _decay_groups(self) -> list[tuple[float, list]]:
        """Each param group's weight decay and the model parameters it steps: a distributed optimizer's groups hold
        flat ranges of main params (1-D whatever the parameter: read so, every parameter would look 1-D and
        ``weight_decay_params`` "not_1d" would be described as "default"), so its own map names the model's."""
        decays = []
        for inner in self.optimizer.chained_optimizers:
            groups = inner.optimizer.param_groups
            params = [group["params"] for group in groups]
            if hasattr(inner, "model_param_group_index_map"):  # DistributedOptimizer
                params = [[] for _ in groups]
                for param, (index, _) in inner.model_param_group_index_map.items():
                    params[index].append(param)
            decays += [(group.get("weight_decay", 0.0), held) for group, held in zip(groups, params, strict=True)]
        return decays

    def _unread_parameters(self) -> list[str]:
        """The model's trained parameters (Megatron's optimizer steps every one that requires a gradient) that no
        rule of the name map reads."""
        read = {id(param) for param in self.states.rules.values()}
        return [name for name, param in self.model.named_parameters() if param.requires_grad and id(param) not in read]

    def _has_masters(self) -> bool:
        return bool(self.states.masters)

    def _layout(self) -> dict:
        return {"dp": self.dp, "ep": self.ep, "distributed_optimizer": self.distributed}
