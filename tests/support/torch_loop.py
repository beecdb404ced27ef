"""The loop of docs/attach.md, "Any torch loop": HF's tiny DeepSeek-V3 (tests/support/train.py's TINY_MODEL) trained
by torch AdamW with or without the recorder (harness.attach.torch.StepRecorder), and what the recorder tests compare
of it: every parameter's and optimizer state tensor's bits at the end. Shared by tests/test_attach_torch.py,
test_attach_hf.py and test_attach_ranks.py."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch

from harness.attach.torch import StepRecorder
from harness.families import model_config
from tests.support import hook_dump_loops
from tests.support.train import TINY_MODEL


def tiny_model():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from harness.runners.torch.hf_families import hf_config

    torch.manual_seed(0)
    model = hf.DeepseekV3ForCausalLM(hf_config(model_config(TINY_MODEL), hf))
    model.train()
    return model


DROPPED = "model.layers.0.mlp.up_proj.weight"  # a trained parameter whose gradient a hook sets to None


def optimizer_of(model, not_1d=True):
    params = list(model.parameters())
    groups = ([{"params": [p for p in params if p.dim() > 1]},
               {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}] if not_1d
              else [{"params": params}])
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train(folder, *, steps_kept="all", not_1d=True, recorded=True, drop=None, steps=2, writer=None, modules_at=(),
          plant=None, plant_grad=None, float64=False, digest_on_device=None, flip_grad=None, state_from=None):
    """The loop of docs/attach.md, "Any torch loop" (without a recorder where not `recorded`; `drop`: a parameter
    whose gradient a hook sets to None after each accumulation; `writer`: a test double put in place of the step
    writer's save; `modules_at`: the recorder's; `plant`: (module, call, amount or None: one ULP) added to the first
    element of that module's output at its call-th forward (tests/support/hook_dump_loops.py's ``plant``);
    `plant_grad`: (module, call): one ULP added to the gradient reaching that module's output at its call-th forward;
    `float64`: the model in float64, a truth run; `digest_on_device`: the recorder's; `flip_grad`: a parameter whose
    accumulated gradient gets its first element's lowest bit flipped at step 1's last backward; `state_from`: a state
    folder (python -m harness state-for) the recorder loads after the step it holds the state of). Returns the
    folder, the model and the optimizer."""
    model = tiny_model().double() if float64 else tiny_model()
    if drop:
        model.get_parameter(drop).register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    if plant:
        hook_dump_loops.plant(model.get_submodule(plant[0]), plant[1], torch, plant[2])
    if plant_grad:
        plant_gradient(model.get_submodule(plant_grad[0]), plant_grad[1])
    if flip_grad:
        flip_at_call(model.get_parameter(flip_grad), 2)
    optimizer = optimizer_of(model, not_1d)
    recorder = (StepRecorder(folder, model, optimizer, TINY_MODEL, steps_kept=steps_kept, stated={"clip_grad": 1.0},
                             modules_at=modules_at, digest_on_device=digest_on_device) if recorded else None)
    if writer:
        recorder.writer.save = writer(recorder.writer.save)
    data = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        losses = []
        for _ in range(2):
            ids = torch.randint(0, TINY_MODEL["vocab_size"], (1, 8), generator=data)
            labels = torch.randint(0, TINY_MODEL["vocab_size"], (1, 8), generator=data)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = model.loss_function(logits=logits, labels=None, vocab_size=TINY_MODEL["vocab_size"],
                                       shift_labels=labels) / 2
            loss.backward()
            losses.append(loss.detach())
        if recorder is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            grads = recorder.grads()
            norm, factor = recorder.clip_grad_norm_(model.parameters(), 1.0)  # the model's order, both runs
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            recorder.record(step, losses, lr, grads, grad_norm=norm, clip_coeff=factor)
            if state_from and step == json.loads((Path(state_from) / "state.json").read_text())["step"]:
                recorder.load_state(state_from)
        optimizer.zero_grad()
    if recorder is not None:
        recorder.close()
    return folder, model, optimizer


def plant_gradient(module, call: int) -> None:
    """A forward hook whose `call`-th forward adds one ULP to the first element of the gradient reaching the
    module's output (a tensor hook registered before any recorder's on that output)."""
    seen = {"calls": 0}

    def bump(grad):
        first = grad.flatten()[0]
        step = torch.nextafter(first, torch.tensor(float("inf"), dtype=first.dtype)) - first
        mask = torch.zeros_like(grad, dtype=torch.bool)
        mask.view(-1)[0] = True
        return torch.where(mask, grad + step, grad)

    def hook(layer, inputs, output):
        seen["calls"] += 1
        if seen["calls"] == call:
            (output[0] if isinstance(output, tuple) else output).register_hook(bump)
    module.register_forward_hook(hook)


def flip_at_call(param, call: int) -> None:
    """After the `call`-th accumulation into `param`'s gradient, the lowest bit of its first element flipped (a
    planted one-bit difference)."""
    seen = {"calls": 0}

    def flip(p):
        seen["calls"] += 1
        if seen["calls"] == call:
            with torch.no_grad():
                p.grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
    param.register_post_accumulate_grad_hook(flip)


def final_bits(model, optimizer) -> dict:
    """Every parameter and every optimizer state tensor at the end, as integers (bits)."""
    tensors = {f"param.{n}": p for n, p in model.named_parameters()}
    tensors |= {f"state.{i}.{k}": v for i, state in optimizer.state_dict()["state"].items() for k, v in state.items()}
    return {name: t.detach().clone().view(torch.int32 if t.dtype == torch.float32 else t.dtype)
            for name, t in tensors.items()}


def assert_same_bits(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    differing = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not differing, differing


def disk_full_at_step_2(save):
    """A test double of the step writer's save: the disk fills when step 2 is written."""
    def save_or_fail(tensors, path, metadata):
        if "step00002" in path:
            raise OSError(errno.ENOSPC, "No space left on device (test double)")
        save(tensors, path, metadata)
    return save_or_fail
