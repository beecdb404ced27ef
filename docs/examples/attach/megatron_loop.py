"""A user's Megatron-Core training loop, written as Megatron-LM's ``pretrain_gpt`` / ``train_step`` drive one, with the
harness's recorder (docs/attach.md; run by tests/test_attach_megatron.py)::

    python docs/examples/attach/megatron_loop.py REPORT/a-megatron_model/request.json OUT
    python -m torch.distributed.run --nproc-per-node 2 docs/examples/attach/megatron_loop.py REQUEST OUT   # train.dp 2

It trains the model and data of a registry training case (its request.json names the checkpoint and settings): the
``GPTModel`` is built and loaded as the harness's megatron_model runner builds it (the family's Megatron config, the
local layer spec, the checkpoint through the name map) with the CPU adapters a Megatron-Core training run needs on a
CPU (``CudaOnCpu``, see harness/runners/megatron/train.py); the loop is this file's: ``DistributedDataParallel``,
``get_megatron_optimizer``, ``OptimizerParamScheduler``, ``get_forward_backward_func()`` with pretrain_gpt's loss
function, ``optimizer.step()``, then the one call ``recorder.record(step, losses)``. ``--unrecorded`` trains without
the recorder and ``--final-state FILE`` saves every parameter and optimizer state tensor at the end (rank 0's): the
two show that the recorder changes nothing (tests/test_attach_megatron.py). ``--device-digests`` keeps no step's
tensors and digests them where they are, as a GPU run does (bits128v1 in torch, the gradients digested before the
step clips them instead of copied), here on the CPU. ``--state-from DIR`` (a folder
``python -m harness state-for RUN_A --step k --as RUN_B`` wrote) loads run A's state after step k before step k + 1
(``recorder.load_state``: the re-feed into this loop; tests/test_attach_refeed_stacks.py).
"""

import argparse
import json
import os
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import save_file

from harness.attach.megatron import MegatronStepRecorder
from harness.case.train_settings import rank_micro_batches
from harness.families import routed_experts
from harness.runners.megatron import model as megatron_model
from harness.runners.megatron.train import CudaOnCpu, expert_shard, init_ranks
from harness.runners.torch import env as torch_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("request", type=Path, help="a training case's request.json (the built-in side's)")
    parser.add_argument("out", type=Path, help="the captured run's folder")
    parser.add_argument("--without-finalize", action="store_true",
                        help="leave config.finalize_model_grads_func unset, as a loop that skips Megatron-LM's setup")
    parser.add_argument("--unrecorded", action="store_true", help="train without the recorder")
    parser.add_argument("--final-state", type=Path, help="save the parameters and optimizer state at the end")
    parser.add_argument("--device-digests", action="store_true",
                        help="keep no step's tensors; digest them where they are (a GPU run's path)")
    parser.add_argument("--state-from", type=Path, help="a state folder (python -m harness state-for) to load after "
                                                        "the step it holds the state of")
    args = parser.parse_args()
    request = json.loads(args.request.read_text())
    m, train = request["config"]["model"], request["config"]["train"]
    device, dtype = torch.device("cpu"), torch.float32

    # The user's model and data: here the case's checkpoint, built and loaded as the harness's runner does.
    if "RANK" in os.environ:  # torchrun: TP 1, every rank data parallel, train.ep of them sharing the experts
        init_ranks(device, train["ep"])
    else:
        megatron_model.init_process_group(device, gloo_groups=True)
    megatron_model.install_adapters(device, m)
    config, _ = megatron_model.translate_config(m, dtype, device, train["ep"])
    model = megatron_model.build_model(config, m, device)
    checkpoint = torch_env.load_inputs(request["checkpoint"], device)
    names = expert_shard(megatron_model.name_map(m), routed_experts(m), train["ep"],
                         parallel_state.get_expert_model_parallel_rank())  # this rank's experts
    megatron_model.load_weights(model, names, checkpoint)
    model.train()
    rank = torch.distributed.get_rank()

    # The user's loop, as Megatron-LM's: DDP, Megatron's optimizer and scheduler, forward_backward_func.
    with CudaOnCpu():
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=train["distributed_optimizer"]), model)
        config.no_sync_func = ddp.no_sync
        if not args.without_finalize:  # Megatron-LM's setup; it also moves the routing biases after every step
            config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=train["lr"], min_lr=train["min_lr"], weight_decay=train["weight_decay"],
            adam_beta1=train["betas"][0], adam_beta2=train["betas"][1], adam_eps=train["eps"],
            clip_grad=train["clip_grad"], bf16=False, params_dtype=dtype,
            use_distributed_optimizer=train["distributed_optimizer"]), [ddp])
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=train["lr"], min_lr=train["min_lr"],
            lr_warmup_steps=train["warmup_steps"], lr_decay_steps=train["decay_steps"],
            lr_decay_style=train["decay_style"], start_wd=train["weight_decay"], end_wd=train["weight_decay"],
            wd_incr_steps=train["decay_steps"], wd_incr_style="constant")
    schedule = {key: train[key] for key in ("warmup_steps", "decay_style", "decay_steps")}
    digests = {"steps_kept": "none", "digest_on_device": True} if args.device_digests else {}
    recorder = None if args.unrecorded else MegatronStepRecorder(args.out, [ddp], optimizer, m, stated=schedule,
                                                                 **digests)
    for step in range(1, train["steps"] + 1):
        batches = [(checkpoint[f"step{step}.mb{mb}.input_ids"].view(1, -1),
                    checkpoint[f"step{step}.mb{mb}.labels"].view(1, -1))
                   for mb in rank_micro_batches(train["micro_batches"], train["dp"], rank)]  # this rank's share
        with CudaOnCpu():
            losses = train_step([ddp], optimizer, scheduler, batches)
        if recorder:
            recorder.record(step, losses)  # the one call after optimizer.step()
        if args.state_from and step == json.loads((args.state_from / "state.json").read_text())["step"]:
            recorder.load_state(args.state_from)  # step + 1 starts from run A's state after this step
    if recorder:
        recorder.close()
    if args.final_state and rank == 0:
        save_file(final_state(model, optimizer), str(args.final_state))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def final_state(model, optimizer) -> dict:
    """Every parameter by name, every state tensor of each inner torch optimizer by its param index and key."""
    state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for at, inner in enumerate(optimizer.chained_optimizers):
        state.update({f"state{at}.{i}.{key}": value.clone() for i, held in inner.optimizer.state_dict()["state"].items()
                      for key, value in held.items() if isinstance(value, torch.Tensor)})
    return state


def train_step(model_chunks, optimizer, scheduler, batches):
    """Megatron-LM's train_step: zero the grad buffers, forward/backward over the micro-batches, optimizer.step(),
    scheduler.step(increment=1); the micro-batches' losses (divided in place by Megatron: as backpropagated)."""
    losses = []

    def forward_step(data, model):  # pretrain_gpt.py's forward_step and loss_func
        ids, labels = next(data)
        t = ids.shape[1]
        position_ids = torch.arange(t, device=ids.device).view(1, -1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), diagonal=1).view(1, 1, t, t)
        mask = labels != -100
        output = model(ids, position_ids, causal, labels=torch.where(mask, labels, torch.zeros_like(labels)))

        def loss_func(output_tensor):
            loss_mask = mask.view(-1).to(output_tensor.dtype)
            loss = torch.sum(output_tensor.view(-1) * loss_mask)
            num_tokens = loss_mask.sum().clone().detach().to(torch.int)
            losses.append(loss)
            return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                            num_tokens.view(1).to(loss.dtype)])}
        return output, loss_func

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=model_chunks,
                                num_microbatches=len(batches), seq_length=batches[0][0].numel(), micro_batch_size=1,
                                forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    if not update_successful:
        raise RuntimeError("Megatron skipped the update")
    scheduler.step(increment=1)
    return losses


if __name__ == "__main__":
    main()
