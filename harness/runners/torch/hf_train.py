"""hf_model's training runner (op ``causal_lm_train``, docs/training.md): N optimizer steps of the case's model family
in HF transformers (the model of ``harness.runners.torch.hf_model``, built by ``hf_families``) with torch's
own training pieces, every per-step quantity written in canonical names through the family's ``[hf.grads]`` rules.

The pieces are torch's and transformers' own: the optimizer the case names, built by its record
(``harness.optimizers``: ``torch.optim.AdamW``, whose foreach / fused flags the case's ``torch_adamw`` picks, "default"
passing neither; ``torch.optim.SGD`` with momentum), ``torch.nn.utils.clip_grad_norm_``, and the ``LambdaLR`` that
``transformers.get_cosine_with_min_lr_schedule_with_warmup`` (or ``get_constant_schedule_with_warmup``) builds, as HF's
Trainer does. The loop around them is this runner's, written as a plain torch training loop: per micro-batch
``(loss / micro_batches).backward()`` (HF Trainer's gradient accumulation), then clip, step, scheduler step. A bf16 case
keeps fp32 master weights: the optimizer updates fp32 copies whose ``.grad`` receives each micro-batch's bf16 gradient
(added into zeros, as Megatron's fp32 grad buffer does), and each step's masters are copied (rounded) into the bf16
model.

On several data-parallel ranks (``train.dp``, docs/training-ranks.md) the model is wrapped in torch's
``DistributedDataParallel`` (gloo on the CPU, NCCL on GPUs): each rank runs its own micro-batches of the global batch
(``(loss / local micro-batches).backward()``, under ``no_sync()`` but the last), DDP averages the gradients over the
ranks in its buckets, and every rank then steps the same optimizer on the same gradients. With bf16 masters the
model's bf16 gradients are reduced by DDP and added into the masters once, after the last micro-batch. Every rank
holds the whole state and digests its own copy: nothing it writes was gathered but the step's losses
(``ranks.global_losses``).

The float64 truth of a training case is this runner in float64 (hf_model's float64 mode: HF's float32 islands lifted).
Where each quantity lives: ``[hf.train]`` of the name map, copied into meta.json.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from harness.case.ops import carried_quantities, step_quantities
from harness.case.train_settings import TrainSettings, rank_micro_batches
from harness.families import model_config
from harness.families.names import NameMap
from harness.run.protocol import Phases, Unsupported, rank_and_world
from harness.run.steps import StepWriter, flips_here, state_locations
from harness.runners.torch import env as torch_env
from harness.runners.torch import hf_families, hf_model, ranks
from harness.runners.torch.train_state import (
    TorchStates,
    device_digests,
    digests_used,
    flip_state,
    host_bytes,
    load_grads,
    load_state,
    save_on_host,
)


class ClipFactor(TorchFunctionMode):
    """Observes, changing nothing, the factor ``clip_grad_norm_`` multiplies the gradients by: the output of its one
    ``torch.clamp`` call (``torch.nn.utils.clip_grad._clip_grads_with_norm_``: clamp(max / (norm + 1e-6), max=1))."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.clamp:
            self.seen.append(out.detach().clone())
        return out

    def factor(self) -> torch.Tensor:
        if len(self.seen) != 1:
            raise RuntimeError(f"clip_grad_norm_ called torch.clamp {len(self.seen)} times; the observer expects "
                               "once (torch.nn.utils.clip_grad changed)")
        return self.seen[0]


def run(request: dict, phases: Phases) -> dict:
    if request["tp"] != 1:
        raise Unsupported(f"one device only (tp=1), got tp={request['tp']}")
    with phases("import"):
        import transformers
        typed = model_config(request["config"]["model"])  # the family resolved once
        hf = hf_families.modeling(typed)
    # HF's own code is put back when the cell ends
    with hf_families.float64_mode(hf, typed, on=request["dtype"] == "float64") as replaced:
        return _run(request, phases, typed, hf, transformers, replaced)


def _run(request: dict, phases: Phases, typed, hf, transformers, float64_mode: dict) -> dict:
    m, train = request["config"]["model"], TrainSettings.from_dict(request["config"]["train"])
    dtype = torch_env.DTYPES[request["dtype"]]
    name_map = NameMap.load(m["family"], "hf")
    rank, world = rank_and_world()
    if world != train.dp or train.ep != 1:
        raise RuntimeError(f"hf_model was started on {world} ranks for dp = {train.dp}, ep = {train.ep} "
                           "(it trains data parallel only)")
    with phases("setup"):
        device = torch_env.select_device(request["device"], int(os.environ.get("LOCAL_RANK", 0)))
        if world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        determinism = torch_env.apply_determinism(device)
        checkpoint = torch_env.load_inputs(request["checkpoint"], device)
        model = hf_model.build_model(hf, m, dtype, device, checkpoint, name_map)
        trainer = Trainer(model, train, m, name_map, dtype, transformers, rank)
        writer = StepWriter(request["output_dir"], train.steps_kept, save_on_host, host_bytes, rank,
                            digests=device_digests(device))
    refeed = request["config"].get("train_refeed")
    for step in range(1, train.steps + 1):
        with phases(f"step {step}"):
            if refeed:  # side a's state after the previous step, and its lr for this one
                load_state(trainer.states, refeed, step, trainer.set_lr, writer.paced)
            digested = writer.digests is not None and step not in writer.kept  # its gradients: digests, no copy
            scalars, states = trainer.step(step, checkpoint, dtype, m["vocab_size"], refeed, digested)
            if scalars:
                writer.write(step, scalars, states)
            if flips_here(train.flip, step, rank):
                flip_state(trainer.states, train.flip)
    if world > 1:
        dist.destroy_process_group()
    return {
        "framework": "pytorch", "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "implementation": f"{hf.__name__}.{hf_families.model_class(typed)} trained with "
                          f"torch.optim.{type(trainer.optimizer).__name__}, "
                          f"torch.nn.utils.clip_grad_norm_ and transformers' LambdaLR schedule "
                          f"({'fp32 master weights' if train.master_weights else 'no master weights'})",
        "adapters": [{"name": "ClipFactor", "why": ClipFactor.__doc__.split(":")[0] + " (an observer)",
                      "changes_computation": False}],
        "knobs": trainer.knobs,
        "state_locations": state_locations(m["family"], "hf", train.record, step_quantities(train.record)),
        "data_parallel": train.dp, "distributed_backend": ("nccl" if device.type == "cuda" else "gloo")
        if world > 1 else None,
        "float64_mode": float64_mode,
        "steps_kept": list(train.steps_kept), "step_digests": digests_used(device), "refeed": refeed or {},
        "determinism": determinism, **torch_env.provenance(device),
    }


class Trainer:
    """The model, its optimizer and schedule, and one training step."""

    def __init__(self, model, train: TrainSettings, m: dict, name_map: NameMap, dtype, transformers, rank: int = 0):
        self.model, self.train, self.micro_batches = model, train, train.micro_batches
        self.mine, self.dp = rank_micro_batches(train.micro_batches, train.dp, rank), train.dp
        # DistributedDataParallel's defaults (25 MB buckets, gradients averaged: divided by the world size, summed)
        self.ddp = torch.nn.parallel.DistributedDataParallel(model) if self.dp > 1 else None
        self.group = ranks.gather_group()
        params = dict(model.named_parameters())
        self.masters = ({name: p.detach().float().clone().requires_grad_(True) for name, p in params.items()}
                        if train.master_weights else {})
        optimized = self.masters or params
        groups, self.knobs = param_groups(optimized, train)
        self.optimizer, knobs = train.record.torch(train.optimizer, groups, train.lr, train.weight_decay)
        self.scheduler = schedule(self.optimizer, train, transformers)
        self.knobs.update({
            **knobs,
            "clip_grad_norm_": {"value": train.clip_grad, "why": "global L2 norm over the optimized tensors' "
                                                                 "gradients (0: not clipped)"},
            "schedule": {"value": type(self.scheduler).__name__ + " from " + self.scheduler_source,
                         "why": f"{train.decay_style}: warmup {train.warmup_steps} steps from 0, "
                                f"decay to {train.min_lr} over {train.decay_steps} steps"},
            "gradient_accumulation": {"value": len(self.mine), "why": "(loss / micro_batches).backward() per "
                                                                       "micro-batch of this rank, as HF's Trainer"},
            "DistributedDataParallel": {"value": {"world_size": self.dp} if self.ddp else None,
                                        "why": "torch.nn.parallel.DistributedDataParallel with its defaults, "
                                               "no_sync() but for the last micro-batch" if self.ddp else
                                               "one rank"},
            "expert_bias_update": {"value": train.expert_bias_update, "why": "HF's training code never changes "
                                                                             "the routing bias"},
        })
        self.states = TorchStates.hf(model, m, name_map, self.optimizer, carried_quantities(train.record),
                                     self.masters)

    @property
    def scheduler_source(self) -> str:
        return ("transformers.get_cosine_with_min_lr_schedule_with_warmup" if self.train.decay_style == "cosine"
                else "transformers.get_constant_schedule_with_warmup")

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, step: int, checkpoint: dict, dtype, vocab: int, refeed: dict | None, digest_grads: bool = False):
        """One optimizer step; `digest_grads`: the gradients digested on the device before clipping, not copied."""
        model, n = self.model, len(self.mine)
        self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        for master in self.masters.values():
            master.grad = torch.zeros_like(master)
        losses = []
        for i, mb in enumerate(self.mine):
            ids = checkpoint[f"step{step}.mb{mb}.input_ids"].view(1, -1)
            labels = checkpoint[f"step{step}.mb{mb}.labels"].view(1, -1)
            last = i == n - 1
            with nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                logits = (model if self.ddp is None else self.ddp)(input_ids=ids, use_cache=False).logits
                if dtype == torch.float64:  # HF's ForCausalLMLoss upcasts to float32 first (hf_model: float64 mode)
                    from transformers.loss.loss_utils import fixed_cross_entropy
                    loss = fixed_cross_entropy(logits.view(-1, vocab), labels.view(-1))
                else:
                    loss = model.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=labels)
                scaled = loss / n
                scaled.backward()
            losses.append(scaled.detach())
            if self.ddp is None or last:  # under DDP the bf16 gradients accumulate in the model until reduced
                params = dict(model.named_parameters())
                for name, master in self.masters.items():
                    param = params[name]
                    if param.grad is not None:
                        master.grad.add_(param.grad)
                        param.grad = None
        if refeed and refeed.get("mode") == "update":  # side a's gradients into this optimizer
            load_grads(self.states, refeed, step)
        lrs = {group["lr"] for group in self.optimizer.param_groups}
        if len(lrs) != 1:
            raise RuntimeError(f"param groups disagree on the lr: {sorted(lrs)}")
        bare = self.train.bare  # bench_speed: the stack's calls alone, nothing observed or written
        grads = {} if bare else self.states.digest_grads() if digest_grads else self.states.grads()
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
        clipping = {}  # without clipping torch computes neither a norm nor a factor: none is written as its own
        if self.train.clip_grad > 0:
            observer = ClipFactor()
            with nullcontext() if bare else observer:
                norm = torch.nn.utils.clip_grad_norm_(optimized, self.train.clip_grad)
            clipping = {} if bare else {"grad_norm": norm, "clip_coeff": observer.factor()}
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, master in self.masters.items():
                params[name].copy_(master)
        if bare:
            return {}, {}
        loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        loss = ranks.global_losses(torch.stack(losses), self.dp, self.group)
        scalars = {"lr": torch.tensor(lrs.pop(), dtype=torch.float64), "loss": loss.to(loss_dtype),
                   **{name: value.detach().reshape(()) for name, value in clipping.items()}}  # the gradients' dtype
        return scalars, self.states.step_outputs(grads)  # host copies: one at a time


def param_groups(optimized: dict, train: TrainSettings) -> tuple[list[dict], dict]:
    """torch's way of exempting parameters from weight decay: a param group with weight_decay 0."""
    choice = train.weight_decay_params
    if choice in ("default", "all"):
        return [{"params": list(optimized.values())}], {
            "weight_decay_params": {"value": choice, "why": "one param group: torch decays every parameter"}}
    decay = [p for p in optimized.values() if p.dim() > 1]
    exempt = [p for p in optimized.values() if p.dim() <= 1]
    return [{"params": decay}, {"params": exempt, "weight_decay": 0.0}], {
        "weight_decay_params": {"value": choice, "why": f"a second param group with weight_decay 0 for the "
                                                        f"{len(exempt)} 1-D parameters (Megatron's default)"}}


def schedule(optimizer, train: TrainSettings, transformers):
    if train.decay_style == "cosine":
        return transformers.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=train.warmup_steps, num_training_steps=train.decay_steps,
            min_lr=train.min_lr)
    return transformers.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=train.warmup_steps)

