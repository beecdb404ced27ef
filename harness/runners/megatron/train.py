"""megatron_model's training runner (op ``causal_lm_train``, docs/training.md): N optimizer steps of the Megatron-Core
``GPTModel`` of ``harness.runners.megatron.model`` with Megatron-Core's own training pieces, as Megatron-LM's
``train_step`` drives them (megatron/training/training.py), every per-step quantity written in canonical names.

- ``DistributedDataParallel`` (``grad_reduce_in_fp32``: Megatron-LM's ``accumulate_allreduce_grads_in_fp32``, which it
  sets for bf16; gradients land in ``param.main_grad``), ``use_distributed_optimizer`` from the case;
- ``get_megatron_optimizer(OptimizerConfig(optimizer=..., ...))``, the optimizer's own fields from its record
  (``harness.optimizers``: "adam" or "sgd"): a ``ChainedOptimizer`` over Megatron's ``FP32Optimizer`` /
  ``Float16OptimizerWithFloat16Params`` (fp32 masters) / ``DistributedOptimizer`` (Adam only), whose inner optimizer
  is ``torch.optim.AdamW`` / ``torch.optim.SGD`` without Transformer Engine or Apex; default param groups exempt 1-D
  parameters from weight decay (``wd_mult`` 0, which reaches the groups through the scheduler),
  ``weight_decay_params = "all"`` passes ``config_overrides={}``;
- ``OptimizerParamScheduler`` (linear warmup from 0, cosine or constant, ``step(increment=1)`` after each step);
- ``get_forward_backward_func()`` (``forward_backward_no_pipelining``) over the micro-batches, with Megatron-LM's
  ``no_sync_func`` and ``finalize_model_grads``; the loss function is Megatron-LM's GPT one (pretrain_gpt.py
  ``loss_func``: the masked sum of per-token losses and the token count; Megatron divides by both counts in place).

On several ranks (``train.dp``, ``train.ep``; docs/training-ranks.md) it runs as Megatron-LM does under torchrun:
``initialize_model_parallel(1, expert_model_parallel_size=ep)``, each data-parallel rank its own micro-batches of the
global batch (``num_microbatches`` = micro_batches / dp), DDP's gradient reduction (an all-reduce, or with the
distributed optimizer a reduce-scatter and the parameters' all-gather) and the MoE layer's allgather token dispatcher
over the expert-parallel ranks. Rank 0 then puts the canonical state back together (``MegatronStates.held``: a
distributed optimizer's shards by its own range maps, another rank's experts) and writes the step; every other rank
writes the digests of what it holds itself, its replicas and its own pieces, before any gather.

CPU adapters (listed in meta.json, none changes a computation; tests/test_train_runners.py ablates each): the model's
(``harness.runners.megatron.model.install_adapters``) and two of the optimizer's, in one ``TorchFunctionMode`` active
around Megatron's training calls on a CPU only:
- ``cuda_factory_to_cpu``: a factory call with a literal ``device="cuda"`` makes its tensor on the CPU
  (optimizer.py ``found_inf`` and scale buffers, clip_grads.py overflow buffers, schedules.py ``total_num_tokens``,
  param_and_grad_buffer.py's warm-up tensor);
- ``tensor_type_cuda_names``: ``Tensor.type()`` without arguments answers ``torch.cuda.FloatTensor`` (etc.) for a CPU
  tensor: optimizer.py, distrib_optimizer.py and clip_grads.py sort parameters by these strings and refuse others.
Observer (changes nothing): ``clip_scale``, the scale ``clip_grad_by_total_norm_fp32`` hands to
``multi_tensor_applier`` (Megatron computes the clip coefficient inside and returns only the norm).
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode

from harness.case.ops import carried_quantities, step_quantities, train_state_names
from harness.case.train_settings import TrainSettings, rank_micro_batches
from harness.families import model_config, routed_experts
from harness.run.cell_state import patch
from harness.run.protocol import Phases, rank_and_world
from harness.run.steps import StepWriter, flips_here, state_locations
from harness.runners.megatron import model as megatron_model
from harness.runners.torch import env as torch_env
from harness.runners.torch import ranks
from harness.runners.torch.overlapped_writes import OverlappedWrites
from harness.runners.torch.train_state import (
    INT_VIEW,
    device_digests,
    digests_used,
    host_bytes,
    keeps_bits,
    load_state,
    save_on_host,
)

TRAIN_ADAPTERS = {
    "cuda_factory_to_cpu": "CPU only: a torch factory call with a literal device='cuda' (optimizer.py, clip_grads.py, "
                           "schedules.py, param_and_grad_buffer.py) makes its tensor on the CPU (a TorchFunctionMode "
                           "around Megatron's training calls)",
    "tensor_type_cuda_names": "CPU only: Tensor.type() without arguments answers the torch.cuda.* type name "
                              "(optimizer.py, distrib_optimizer.py and clip_grads.py accept only those)",
}
FLOAT64_ADAPTER = {
    "float64_as_fp32_type_name": "float64 cases only: Tensor.type() answers torch.cuda.FloatTensor for a float64 "
                                 "tensor, so clip_grads.py's assert (fp32 main grads only) lets Megatron's optimizer "
                                 "run on float64 parameters; the computation stays float64 (Megatron's norm itself "
                                 "is rounded to fp32 by local_multi_tensor_l2_norm, stated in [megatron.float64])",
}


CPU_STREAM_WHY = ("CPU only: torch.cuda.current_stream() answers a stand-in whose wait_event / wait_stream do "
                  "nothing (megatron-core 0.19's param_and_grad_buffer.start_grad_sync asks for the stream to wait on "
                  "CUDA-graph events, of which a CPU run has none)")


def _waits_on_streams() -> bool:
    """Whether Megatron's grad sync asks torch.cuda for the current stream (megatron-core >= 0.19), where this
    torch has no CUDA."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("megatron-core").split(".")[:2])
    return (major, minor) >= (0, 19) and not torch.cuda.is_available()


class CpuStream:
    """torch.cuda.current_stream() on a CPU (``cpu_current_stream``): nothing runs asynchronously, nothing to wait
    for."""

    def wait_event(self, _event) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass


class CudaOnCpu(TorchFunctionMode):
    """The two CPU adapters of Megatron's training code (see the module docstring); `skip` names the ones left out
    (the ablation tests)."""

    def __init__(self, skip=(), on_cpu: bool = True, float64: bool = False):
        super().__init__()
        self.factories = on_cpu and "cuda_factory_to_cpu" not in skip
        self.type_names = on_cpu and "tensor_type_cuda_names" not in skip
        self.float64 = float64 and "float64_as_fp32_type_name" not in skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if self.factories and isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if self.float64:
                name = name.replace("DoubleTensor", "FloatTensor")
            return name.replace("torch.", "torch.cuda.", 1) if self.type_names and ".cuda." not in name else name
        return func(*args, **kwargs)


@contextmanager
def clip_scale():
    """Observe the scale Megatron's clip_grad_by_total_norm_fp32 multiplies the main grads by (one call per chained
    optimizer that clips; none when its coefficient is >= 1)."""
    from megatron.core.optimizer import clip_grads

    seen: list[float] = []
    original = clip_grads.multi_tensor_applier

    def applier(op, noop_flag, tensor_lists, *args):
        if op is clip_grads.multi_tensor_scale_impl:
            seen.append(args[0])
        return original(op, noop_flag, tensor_lists, *args)

    clip_grads.multi_tensor_applier = applier
    try:
        yield seen
    finally:
        clip_grads.multi_tensor_applier = original


def run(request: dict, phases: Phases, skip_adapters=()) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    megatron_model.admit(request)
    m, train = model_config(request["config"]["model"]), TrainSettings.from_dict(request["config"]["train"])
    dtype = megatron_model.DTYPES[request["dtype"]]
    rank, world = rank_and_world()
    if world != train.dp:
        raise RuntimeError(f"megatron_model was started on {world} ranks; the request trains on dp = {train.dp}")
    with phases("setup"):
        device = torch_env.select_device(request["device"], int(os.environ.get("LOCAL_RANK", 0)))
        init_ranks(device, train.ep)
        group = ranks.gather_group()
        determinism = torch_env.apply_determinism(device)
        adapters = megatron_model.install_adapters(device, m, skip_adapters)
        on_cpu, float64 = device.type == "cpu", dtype == torch.float64
        named = {**(TRAIN_ADAPTERS if on_cpu else {}), **(FLOAT64_ADAPTER if float64 else {})}
        if on_cpu and _waits_on_streams() and "cpu_current_stream" not in skip_adapters:
            patch(torch.cuda, "current_stream", lambda device=None: CpuStream())
            named["cpu_current_stream"] = CPU_STREAM_WHY
        adapters += [{"name": n, "why": why, "changes_computation": False} for n, why in named.items()
                     if n not in skip_adapters]
        adapters.append({"name": "clip_scale", "why": clip_scale.__doc__.split("(")[0].strip() + " (an observer)",
                         "changes_computation": False})
        mode = (lambda: CudaOnCpu(skip_adapters, on_cpu, float64)) if on_cpu or float64 else _nothing
        config, knobs = megatron_model.translate_config(m, dtype, device, train.ep)
        if train.expert_bias_update == "off":  # read by finalize_model_grads after every step's backward
            config.moe_router_bias_update_rate = 0.0
        model = megatron_model.build_model(config, m, device)
        full = megatron_model.name_map(m)
        names = expert_shard(full, routed_experts(m), train.ep, parallel_state.get_expert_model_parallel_rank())
        checkpoint = torch_env.load_inputs(request["checkpoint"], device)
        megatron_model.load_weights(model, names, checkpoint)
        model.train()
        own, _, _ = train.record.megatron(train.optimizer)  # optimizer= and the optimizer's own fields
        with mode():
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(  # float64 keeps float64 grads
                grad_reduce_in_fp32=not float64, use_distributed_optimizer=train.distributed_optimizer), model)
            config.no_sync_func = ddp.no_sync
            config.finalize_model_grads_func = finalize_model_grads
            optimizer_config = OptimizerConfig(
                lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay, **own, clip_grad=train.clip_grad,
                bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=train.distributed_optimizer)
            overrides = {} if train.weight_decay_params == "all" else None  # None: Megatron's standard groups
            optimizer = get_megatron_optimizer(optimizer_config, [ddp], config_overrides=overrides)
            # its __init__ sets each group's lr and weight_decay (x wd_mult): SGD's 1-D groups get their 0 only here
            scheduler = OptimizerParamScheduler(
                optimizer, init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr,
                lr_warmup_steps=train.warmup_steps, lr_decay_steps=train.decay_steps,
                lr_decay_style=train.decay_style, start_wd=train.weight_decay, end_wd=train.weight_decay,
                wd_incr_steps=train.decay_steps, wd_incr_style="constant")
        states = MegatronStates(names, model, optimizer, dict(train_state_names(m)), group, train.ep,
                                carried_quantities(train.record), routed_expert_names(full))
        if train.ep == 1 and set(states.rules) != set(states.shapes):
            raise RuntimeError("[megatron.parameters] does not cover exactly the canonical parameters")
        writer = StepWriter(request["output_dir"], train.steps_kept, save_on_host, host_bytes, rank,
                            digests=device_digests(device))
        writes = OverlappedWrites(writer, device)
    refeed = request["config"].get("train_refeed")
    for step in range(1, train.steps + 1):
        with phases(f"step {step}"):
            if refeed:
                writes.flush()
                load_state(states, refeed, step, states.set_lr, writer.paced)
            digested = writer.digests is not None and step not in writer.kept  # its gradients: digests, no copy
            scalars, tensors, pieces, doubles = train_step(ddp, optimizer, scheduler, states, checkpoint, step, train,
                                                           dtype, refeed, rank, mode, digested, writes.flush)
            if scalars:  # the routing biases: finalize_model_grads updates them after the next step's backward
                writes.write(step, scalars, tensors, pieces, doubles,
                             frozenset(name for name in tensors if name.startswith("expert_bias.")))
            if flips_here(train.flip, step, rank):
                writes.flush()
                states.flip(train.flip)
            if step == train.steps:  # the last step's digests are its own time
                writes.flush()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    from megatron.core import __version__ as megatron_version

    from harness.runners.megatron import gdn
    from harness.runners.megatron.runner import te_version

    return {"framework": "megatron-core", "versions": {"megatron-core": megatron_version, **te_version(),
                                                       **gdn.versions(m)},
            "implementation": "megatron.core GPTModel (local spec) trained with DistributedDataParallel, "
                              "get_megatron_optimizer (" + " + ".join(type(o).__name__ for o in
                                                                      optimizer.chained_optimizers)
                              + ", inner " + type(optimizer.chained_optimizers[0].optimizer).__name__
                              + "), OptimizerParamScheduler, forward_backward_no_pipelining",
            "adapters": adapters,
            "knobs": {**knobs, **training_knobs(train, optimizer, config.moe_router_bias_update_rate)},
            "state_locations": state_locations(m.family, "megatron", train.record,
                                               step_quantities(train.record)),
            "steps_kept": list(train.steps_kept), "step_digests": digests_used(device), "refeed": refeed or {},
            "determinism": determinism,
            "tensor_parallel": 1, "data_parallel": train.dp, "expert_parallel": train.ep,
            "distributed_backend": "nccl" if device.type == "cuda" else "gloo",
            **torch_env.provenance(device)}


@contextmanager
def _nothing():
    yield


def init_ranks(device: torch.device, expert_parallel: int) -> None:
    """The process group (torchrun's ranks, or one of its own) and Megatron's parallel state: TP 1, every rank a
    data-parallel rank, `expert_parallel` of them sharing one MoE layer's experts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # get_megatron_optimizer (0.19.2) asks for the data-parallel gloo group even on a GPU (measured on the H200)
    if "RANK" not in os.environ:  # one rank: the model runner's own setup (gloo or NCCL, world size 1)
        megatron_model.init_process_group(device, gloo_groups=True)
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             expert_model_parallel_size=expert_parallel,
                                             create_gloo_process_groups=True)


EXPERT_INDEX = re.compile(r"(?<=\.local_experts\.)\d+(?=\.)")  # a routed expert in Megatron's MoE layer


def routed_expert_names(names: dict) -> frozenset:
    """The canonical names of the routed experts' parameters: those the family's name map puts in Megatron's
    ``local_experts`` (SequentialMLP)."""
    return frozenset(c for c, (megatron, _) in names["parameters"].items() if EXPERT_INDEX.search(megatron))


def expert_shard(names: dict, experts: int, expert_parallel: int, ep_rank: int) -> dict:
    """The name map on one expert-parallel rank: its own experts only (global expert ep_rank x experts / ep + i is
    its local expert i, as Megatron's MoELayer numbers them), the rest of the model whole."""
    if expert_parallel == 1:
        return names
    per_rank = experts // expert_parallel
    first = ep_rank * per_rank
    parameters = {}
    for canonical, (megatron, sources) in names["parameters"].items():
        index = EXPERT_INDEX.search(megatron)
        if index is not None:
            expert = int(index.group())
            if not first <= expert < first + per_rank:
                continue
            megatron = megatron[:index.start()] + str(expert - first) + megatron[index.end():]
        parameters[canonical] = (megatron, sources)
    return {**names, "parameters": parameters}


def train_step(ddp, optimizer, scheduler, states, checkpoint, step: int, train: TrainSettings, dtype, refeed,
               rank: int = 0, mode=None, digest_grads: bool = False, before_update=lambda: None):
    """Megatron-LM's train_step: zero the grad buffer, forward/backward over this rank's micro-batches,
    optimizer.step(), scheduler.step(increment=1). `mode` (the CPU adapters' TorchFunctionMode) is entered around
    Megatron's calls only: the harness's reading of the state between them is not Megatron's code and would pay the
    mode's Python on each of its torch calls (310,000 of the 675,000 a 10-step CPU profile passed through it).
    `digest_grads`: the gradients digested on the device before the step clips them, not copied (``held_grads``);
    `before_update`: called before anything changes the state (``OverlappedWrites.flush``)."""
    mode = mode or _nothing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mine = rank_micro_batches(train.micro_batches, train.dp, rank)
    n = len(mine)
    losses = []

    def forward_step(batches, model):
        ids, labels = next(batches)
        t = ids.shape[1]
        position_ids = torch.arange(t, device=ids.device).view(1, -1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), diagonal=1).view(1, 1, t, t)
        mask = labels != megatron_model.IGNORE_INDEX
        per_token = model(ids, position_ids, causal, labels=torch.where(mask, labels, torch.zeros_like(labels)))

        def loss_func(output):  # pretrain_gpt.py loss_func: masked sum and token count (Megatron divides in place)
            loss_mask = mask.view(-1).to(output.dtype)
            loss = torch.sum(output.view(-1) * loss_mask)
            num_tokens = loss_mask.sum().clone().detach().to(torch.int)
            losses.append(loss)  # divided in place by num_tokens and num_microbatches once Megatron returns
            return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                            num_tokens.view(1).to(loss.dtype)])}
        return per_token, loss_func

    device = next(ddp.parameters()).device
    batches = iter([(checkpoint[f"step{step}.mb{mb}.input_ids"].to(device).view(1, -1),
                     checkpoint[f"step{step}.mb{mb}.labels"].to(device).view(1, -1)) for mb in mine])
    with mode():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches, model=[ddp],
                                    num_microbatches=n, seq_length=checkpoint["step1.mb0.input_ids"].numel(),
                                    micro_batch_size=1, forward_only=False)
    if refeed and refeed.get("mode") == "update":  # side a's gradients into this optimizer
        from harness.runners.torch.train_state import load_grads
        load_grads(states, refeed, step)
    before_update()  # the previous step's file (its digests ran beside this step's forward and backward)
    lr = states.lr()
    bare = train.bare  # bench_speed: Megatron's calls alone, nothing observed or written
    tensors, pieces = ({}, {}) if bare else held_grads(states, digest_grads)  # optimizer.step() clips them in place
    with nullcontext([]) if bare else clip_scale() as scales, mode():
        update_successful, grad_norm, _ = optimizer.step()
    if not update_successful:
        raise RuntimeError(f"Megatron skipped step {step} (found inf/nan in the gradients)")
    if len(set(scales)) > 1:
        raise RuntimeError(f"chained optimizers clipped by different scales: {scales}")
    with mode():
        scheduler.step(increment=1)
    if bare:
        return {}, {}, {}, {}
    return step_outputs(states, losses, lr, (tensors, pieces), grad_norm, scales, train.clip_grad > 0, train.dp,
                        dtype)


def step_outputs(states, losses, lr: float, grads: tuple[dict, dict], grad_norm, scales: list, clipped: bool,
                 dp: int, dtype) -> tuple[dict, dict, dict, dict]:
    """What a step writes, after Megatron's ``optimizer.step()``: (scalars, tensors, pieces, doubles) for
    ``StepWriter.write``. `losses` the step's micro-batch losses as backpropagated, `grads` ``held_grads`` taken
    before the step, `grad_norm` the step's return, `scales` what ``clip_scale`` saw. The one
    reader of this runner and of the recorder in a user's Megatron-Core loop (``harness.attach``)."""
    tensors, pieces = dict(grads[0]), dict(grads[1])
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    loss = ranks.global_losses(torch.stack(losses).detach(), dp, states.group)
    # Megatron's norm and clip coefficient are Python doubles; the coefficient reaches the main grads through
    # local_multi_tensor_scale's `grad * scale`, which torch computes at the gradients' precision (the scale rounded
    # to float32 for fp32 grads: tests/test_train_runners.py): those values are compared, the doubles shown beside
    scalars = {"lr": torch.tensor(lr, dtype=torch.float64), "loss": loss.to(wide),
               "grad_norm": torch.tensor(float(grad_norm), dtype=wide)}
    doubles = {"grad_norm": float(grad_norm)}
    if clipped:  # 1 when the coefficient is >= 1: the gradients are left as they are
        scalars["clip_coeff"] = torch.tensor(scales[0] if scales else 1.0, dtype=wide)
        doubles["clip_coeff"] = float(scales[0]) if scales else 1.0
    for quantity in states.carried:
        if quantity == "master" and not states.masters:
            continue
        whole, parts = held(states, quantity)
        tensors.update(whole)
        pieces.update(parts)
    # Megatron keeps the routing bias in float32 whatever the model's dtype (TopKRouter._maintain_float32_expert_bias):
    # a float64 case gets it upcast, exactly
    tensors.update({f"expert_bias.{name}": buffer.to(wide) for name, buffer in states.buffers.items()})
    return scalars, tensors, pieces, doubles  # on the device: host copies one at a time


def held_grads(states, digested: bool) -> tuple[dict, dict]:
    """``held``'s gradients as ``optimizer.step()`` is handed them (it clips them in place): copies, or where the step
    is not kept and its digests are made on the device, digests made now (``Digested``), no copy of every gradient
    (Megatron's fp32 main grads: 17.6 GB at full width)."""
    if not digested:
        return held(states, "grad", clone=True)
    from harness.runners.torch.digest import digest_now

    whole, pieces = held(states, "grad")
    spans = [(name, start, end, values) for name, parts in pieces.items() for start, end, values in parts]
    made = digest_now({**whole, **{f"{name}[{start}:{end}]": values for name, start, end, values in spans}})
    pieced: dict[str, list] = {}
    for name, start, end, _ in spans:
        pieced.setdefault(name, []).append((start, end, made[f"{name}[{start}:{end}]"]))
    return {name: made[name] for name in whole}, pieced


def held(states, quantity: str, clone: bool = False) -> tuple[dict, dict]:
    """``MegatronStates.held`` of `quantity` in step-file names (``grad.<p>``), copied when `clone`."""
    def copy(tensor: torch.Tensor) -> torch.Tensor:  # only a parameter requires grad: detach it alone
        tensor = tensor.detach() if tensor.requires_grad else tensor
        return tensor.clone() if clone else tensor

    whole, pieces = states.held(quantity)
    return ({f"{quantity}.{name}": copy(t) for name, t in whole.items()},
            {f"{quantity}.{name}": [(start, end, copy(t)) for start, end, t in parts]
             for name, parts in pieces.items()})


class RowOrder:
    """A name map's ``rope_rows`` as ``MegatronStates`` reads a part: the Megatron row of each canonical row, in
    order (the permutation's inverse), so every quantity of the parameter is read and written in HF's row order."""

    index = None

    def __init__(self, megatron_rows: list[int]):
        self.megatron_rows = megatron_rows

    def rows(self, _index=None) -> list[int]:
        return self.megatron_rows


class MegatronStates:
    """The per-parameter state of Megatron's optimizer in canonical names (the interface of
    harness.runners.torch.train_state), through the family's name map ([megatron.parameters], read by
    ``harness.runners.megatron.model.name_map``): a canonical tensor is a Megatron parameter as it is (fc1 is the
    canonical gate_up_proj), or one part of a fused one, whose rows the map's de-interleave rule names (q, k and v
    interleaved per query group in linear_qkv: the same rule takes their gradients at the model level). Every
    quantity of a part (gradient, main param, optimizer state, parameter) is those rows of the fused tensor's. A
    parameter's main param and optimizer state come from the chained optimizer that owns it.

    On several ranks (`group`: harness.runners.torch.ranks) a rank holds pieces: a distributed optimizer owns a range
    of each flattened parameter on each data-parallel rank (its main param, Adam's moments, and the reduced gradient
    there: ``_get_model_param_range_map``: a part of a fused tensor is then as many pieces as its query groups the
    range meets), and an expert-parallel rank holds its own experts only (`experts`). ``held`` gives
    what a rank writes of a quantity (rank 0: every tensor put back together); ``put`` writes each rank's part of a
    canonical tensor. `carried`: what a step hands to the next (harness.case.ops.carried_quantities)."""

    def __init__(self, names: dict, model, optimizer, shapes: dict | None = None, group=None,
                 expert_parallel: int = 1, carried: tuple[str, ...] = (), experts: frozenset = frozenset()):
        self.carried = carried
        params = dict(model.named_parameters())
        self.rules = {canonical: params[megatron] for canonical, (megatron, _) in names["parameters"].items()}
        # a canonical tensor that is one part of a fused Megatron tensor (q, k or v of linear_qkv): the name map's
        # rule that takes it (kind deinterleave, harness.families.names), as the model level takes its gradient
        self.parts = {name: rule for name, rule in names.get("parts", {}).items() if name in self.rules}
        for name, perm in names.get("rope_rows", {}).items():  # GLM-5's rope rows, Qwen3.5's gated q_proj's
            if name in self.rules:  # permuted on loading, within the rows of their part of a fused tensor if one
                part = self.parts.get(name)
                rows = part.rows(part.index) if part is not None else range(len(perm))
                self.parts[name] = RowOrder([rows[r] for r in torch.argsort(perm).tolist()])
        # zero-centred gammas Megatron holds as 1 + w (names.toml zero_centred): their param and master read as
        # gamma - 1, exact for gamma in [0.5, 2] (Sterbenz), and written back as 1 + w
        self.one_plus = {name for name in names.get("one_plus", ()) if name in self.rules}
        self.shapes = shapes or {name: (len(self.parts[name].rows(self.parts[name].index)), *param.shape[1:])
                                 if name in self.parts else tuple(param.shape) for name, param in self.rules.items()}
        self.experts = experts  # the routed experts' canonical names: held in pieces on several expert-parallel ranks
        self._runs: dict[str, list[tuple[int, int, int]]] = {}
        self.optimizer, self.group, self.expert_parallel = optimizer, group, expert_parallel
        self.owner: dict[torch.Tensor, tuple] = {}  # model param -> (chained optimizer, main param or None)
        self.distributed = False
        for inner in optimizer.chained_optimizers:
            if hasattr(inner, "model_param_group_index_map"):  # DistributedOptimizer: the params it holds a range of
                self.distributed = True
                for param in inner.model_param_group_index_map:
                    self.owner[param] = (inner, None)
            elif hasattr(inner, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
                for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups,
                                                   strict=True):
                    for param, main in zip(model_group, main_group, strict=True):
                        self.owner[param] = (inner, main)
                for group_ in inner.fp32_from_fp32_groups:
                    for param in group_:
                        self.owner[param] = (inner, param)
            else:  # FP32Optimizer: AdamW or SGD on the model parameters
                for group_ in inner.optimizer.param_groups:
                    for param in group_["params"]:
                        self.owner[param] = (inner, param)
        self.masters = any(p.dtype != torch.float32 and p.dtype != torch.float64 for p in self.rules.values())
        buffers = dict(model.named_buffers())
        self.buffers = {canonical: buffers[megatron] for canonical, (megatron, _) in names["buffers"].items()}

    def lr(self) -> float:
        lrs = {group["lr"] for inner in self.optimizer.chained_optimizers for group in inner.optimizer.param_groups}
        if len(lrs) != 1:
            raise RuntimeError(f"param groups disagree on the lr: {sorted(lrs)}")
        return lrs.pop()

    def set_lr(self, lr: float) -> None:
        for inner in self.optimizer.chained_optimizers:
            for group in inner.optimizer.param_groups:
                group["lr"] = lr

    def runs(self, name: str) -> list[tuple[int, int, int]]:
        """(canonical start, Megatron start, length) of the runs of `name`'s flattened elements that lie together in
        the flattened Megatron tensor holding it: one run for a tensor Megatron holds as it is, one per query group
        for a part of a fused one (q, k or v of linear_qkv: the rows its name-map rule de-interleaves)."""
        if name not in self._runs:
            numel = math.prod(self.shapes[name])
            rule = self.parts.get(name)
            if rule is None:
                self._runs[name] = [(0, 0, numel)]
            else:
                rows = rule.rows(rule.index)
                width = numel // len(rows)  # elements per row (1 for a bias)
                runs: list[list[int]] = []
                for i, row in enumerate(rows):
                    if runs and runs[-1][1] + runs[-1][2] == row * width:
                        runs[-1][2] += width
                    else:
                        runs.append([i * width, row * width, width])
                self._runs[name] = [tuple(run) for run in runs]
        return self._runs[name]

    def pieces(self, quantity: str, name: str) -> list[tuple[int, int, torch.Tensor]]:
        """The elements of canonical tensor `name` this rank holds, as (start, end, values) pieces of its flattening,
        each a view of Megatron's own tensor: one piece for the whole of a tensor Megatron holds as it is, the
        distributed optimizer's range of it, one piece per query group of a part of a fused tensor (the rows of q,
        k or v in linear_qkv) and of such a part within a range; none where this rank holds nothing of it."""
        span = self._span(quantity, name)
        if span is None:
            return []
        start, end, values = span
        held = []
        for canonical, megatron, length in self.runs(name):
            low, high = max(start, megatron), min(end, megatron + length)
            if low < high:
                held.append((canonical + low - megatron, canonical + high - megatron,
                             values[low - start:high - start]))
        return held

    def whole(self, quantity: str, name: str) -> torch.Tensor:
        """Canonical tensor `name`, which this rank holds whole: Megatron's tensor or a view of it, or for a part of a
        fused one its rows put together (a copy)."""
        param = self.rules.get(name)
        if (name not in self.parts and not self.distributed and param is not None
                and (quantity == "param" or param in self.owner)):  # Megatron's own tensor as it is (most of them):
            source = self._source(quantity, name)  # no view to make, ~3,200 a step at Kimi-K2's widths
            if tuple(source.shape) == tuple(self.shapes[name]):
                return source
        held = self.pieces(quantity, name)
        if len(held) == 1 and held[0][:2] == (0, math.prod(self.shapes[name])):
            return held[0][2].view(self.shapes[name])
        return ranks.assemble(f"{quantity}.{name}", self.shapes[name], held)

    def _span(self, quantity: str, name: str) -> tuple[int, int, torch.Tensor] | None:
        """(start, end, values) of the flattened Megatron tensor holding canonical tensor `name` that this rank
        holds (the whole of it, a distributed optimizer's range, or None), the values a view of Megatron's own
        tensor."""
        if name not in self.rules:  # another expert-parallel rank's expert
            return None
        param = self.rules[name]
        whole = param.numel()
        if quantity == "param":
            return 0, whole, param.view(-1)
        if param not in self.owner:  # a distributed optimizer holds no range of it on this rank
            return None
        inner, main = self.owner[param]
        if main is None:  # the distributed optimizer's range (the whole parameter on one data-parallel rank)
            span = inner._get_model_param_range_map(param)["param"]
            if quantity == "grad":  # the reduce-scatter left the reduced gradient in this range only
                return span.start, span.end, param.main_grad.view(-1)[span.start:span.end]
            tensors = inner._get_main_param_and_optimizer_states(param)
            key = "param" if quantity == "master" else quantity
            if key not in tensors:
                raise RuntimeError(f"Megatron's optimizer keeps no {quantity!r} for {name}")
            return span.start, span.end, tensors[key].view(-1)
        return 0, whole, self._source(quantity, name).view(-1)

    def _source(self, quantity: str, name: str) -> torch.Tensor:
        """The tensor Megatron keeps `quantity` of canonical tensor `name` in, where the optimizer is not distributed:
        the parameter, its main grad, its main param or its optimizer state."""
        param = self.rules[name]
        if quantity == "param":
            return param
        if quantity == "grad":
            return param.main_grad
        inner, main = self.owner[param]
        if quantity == "master":
            return main
        state = inner.optimizer.state.get(main, {})
        if quantity not in state:
            raise RuntimeError(f"Megatron's optimizer keeps no {quantity!r} for {name}")
        return state[quantity]

    def _pieced(self, quantity: str, name: str) -> bool:
        """Whether ranks hold `name`'s `quantity` in pieces (the same answer on every rank): an expert on several
        expert-parallel ranks, and the distributed optimizer's quantities (all but the parameter) on several ranks."""
        if self.group is None:
            return False
        if self.expert_parallel > 1 and name in self.experts:
            return True
        return self.distributed and quantity != "param"

    def held(self, quantity: str) -> tuple[dict, dict]:
        """What this rank writes of `quantity` (on several ranks a collective: every rank calls it alike):
        ({name: canonical tensor}, {name: [(start, end, flat values)]}). Rank 0: every canonical tensor whole (the
        pieces gathered to it), and of each tensor held in pieces the places the other ranks hold, from it; another
        rank: the tensors it holds whole (its replicas), and its own pieces of the others, before any gather."""
        pieced = [name for name in self.shapes if self._pieced(quantity, name)]
        whole = {name: self._canonical(quantity, name, self.whole(quantity, name)) for name in self.shapes
                 if name not in pieced}
        if not pieced:
            return whole, {}
        own = {name: [(start, end, self._canonical(quantity, name, values)) for start, end, values in held]
               for name in pieced if (held := self.pieces(quantity, name))}
        gathered, places = ranks.gather_pieces(own, self.shapes, self.group, next(iter(self.rules.values())).device)
        if torch.distributed.get_rank(self.group) != 0:
            return whole, own
        whole.update(gathered)
        return whole, {name: [(start, end, whole[name].reshape(-1)[start:end]) for start, end in spans]
                       for name, spans in places.items()}

    @torch.no_grad()
    def flip(self, flip) -> None:
        """The negative control's bit (a ``harness.case.train_settings.Flip``), in this rank's own part of the tensor (a
        view of Megatron's own): a rank that does not hold the element leaves it; one named by ``flip.rank`` must hold
        it."""
        flat = 0
        for i, size in zip(flip.index, self.shapes[flip.tensor], strict=True):
            flat = flat * size + i
        held = self.pieces(flip.state, flip.tensor)
        for start, end, values in held:
            if start <= flat < end:
                bits = values.view(INT_VIEW[values.dtype])
                bits[flat - start] ^= 1 << flip.bit  # the registry keeps the bit below the sign bit
                return
        if flip.rank is not None:
            raise RuntimeError(f"train.flip.rank = {flip.rank}: this rank holds no element {list(flip.index)} "
                               f"of the {flip.state} of {flip.tensor} (holds "
                               f"{', '.join(f'elements {s}:{e}' for s, e, _ in held) or 'none'})")

    @torch.no_grad()
    def put(self, quantity: str, name: str, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.shapes[name]):
            raise ValueError(f"{quantity}.{name}: canonical shape {list(self.shapes[name])}, given {list(value.shape)}")
        if quantity in ("param", "master") and name in self.one_plus:
            value = 1.0 + value
        for start, end, values in self.pieces(quantity, name):
            keeps_bits(value, values.dtype, f"{quantity}.{name}")
            values.copy_(value.reshape(-1)[start:end])

    def _canonical(self, quantity: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A quantity as HF names it: a zero-centred gamma's param and master less 1 (a copy); others as they are."""
        if quantity in ("param", "master") and name in self.one_plus:
            return tensor.detach() - 1.0
        return tensor


def training_knobs(train: TrainSettings, optimizer, bias_update_rate: float) -> dict:
    groups = [(inner.optimizer.param_groups) for inner in optimizer.chained_optimizers]
    exempt = sum(len(g["params"]) for gs in groups for g in gs if g.get("wd_mult", 1.0) == 0.0)
    own, shown, why = train.record.megatron(train.optimizer)
    return {
        "OptimizerConfig": {"value": {"optimizer": own["optimizer"], "lr": train.lr, "min_lr": train.min_lr,
                                      "weight_decay": train.weight_decay, **shown, "clip_grad": train.clip_grad,
                                      "use_distributed_optimizer": train.distributed_optimizer},
                            "why": why},
        "weight_decay_params": {"value": train.weight_decay_params,
                                "why": f"{exempt} parameters in groups with wd_mult 0 ("
                                       + ("Megatron's standard overrides: 1-D parameters and biases"
                                          if train.weight_decay_params != "all" else "config_overrides={}")
                                       + ")"},
        "DistributedDataParallelConfig": {"value": {"grad_reduce_in_fp32": "True (float64: False)",
                                                    "use_distributed_optimizer": train.distributed_optimizer},
                                          "why": "Megatron-LM accumulates and reduces gradients in fp32 for bf16 "
                                                 "(accumulate_allreduce_grads_in_fp32)"},
        "OptimizerParamScheduler": {"value": {"init_lr": 0.0, "max_lr": train.lr, "min_lr": train.min_lr,
                                              "lr_warmup_steps": train.warmup_steps,
                                              "lr_decay_steps": train.decay_steps,
                                              "lr_decay_style": train.decay_style},
                                    "why": "step(increment=1) after every optimizer step, as Megatron-LM with "
                                           "micro-batch size 1 counted in steps"},
        "micro_batches": {"value": train.micro_batches, "why": "forward_backward_no_pipelining's "
                                                               "num_microbatches (gradient accumulation)"},
        "moe_router_bias_update_rate": {"value": bias_update_rate,
                                        "why": f"expert_bias_update = {train.expert_bias_update!r} (else the "
                                               "family's Megatron config's): finalize_model_grads moves each "
                                               "routing bias by sign(mean load - load) x this rate after every "
                                               "step's backward"},
    }
