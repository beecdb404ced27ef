"""A user's HF ``Trainer`` run with the harness's recorder attached (docs/attach.md's worked example; run by
tests/test_attach_hf.py).

It trains the model and data of a registry training case (the checkpoint a ``compare`` of that case made; its
request.json names the files and settings) with ``transformers.Trainer`` as any Trainer user does, adds
``harness.attach.hf.attach`` (one line), and leaves a captured run in OUT that ``python -m harness compare-runs``
compares with the built-in ``hf_model`` runner's folder (or any other captured run)::

    python docs/examples/attach/hf_trainer.py REPORT/b-hf_model/request.json OUT [--max-grad-norm 1.0]

``--unrecorded`` trains without the recorder and ``--final-state FILE`` saves every parameter and optimizer state
tensor at the end: the two show that the recorder changes nothing (tests/test_attach_hf.py); ``--drop-grad NAME``
sets that parameter's gradient to None after each accumulation (a trained parameter without a gradient);
``--state-from DIR`` (a folder ``python -m harness state-for RUN_A --step k --as RUN_B`` wrote) starts step k + 1
from run A's state after step k (the callback's ``state_from``: the re-feed into this Trainer).

What it sets so the Trainer does what hf_model's runner does (docs/attach.md says why each matters):
``train_sampling_strategy="sequential"`` (the case's micro-batches in order), the case's labels passed as
``shift_labels`` (they are next-token targets already; ``labels`` would be shifted again and lose the last token),
``remove_unused_columns=False`` (else the Trainer drops ``shift_labels``, which the model's signature does not name),
``trainer.model_accepts_loss_kwargs = False`` (each micro-batch's mean loss divided by the accumulation steps, as the
runner backpropagates, instead of the step's summed loss over its token count), and
``trainer.accelerator.gradient_accumulation_steps = 1`` (transformers 5.3.0 passes its accumulation steps to
accelerate, whose ``backward`` divides the loss by them a second time: transformers issue 45305, fixed upstream by
PR 45349; ``--as-shipped`` leaves it, and compare-runs shows where that goes). The optimizer (the Trainer's
own ``adamw_torch``: 1-D parameters undecayed, the case's ``weight_decay_params = "not_1d"``), its schedule
(``cosine_with_min_lr``) and clipping (``max_grad_norm``) are the Trainer's own, set from the case.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments

from harness import families
from harness.attach.hf import attach
from harness.families.names import NameMap
from harness.runners.torch import env as torch_env
from harness.runners.torch import hf_families, hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("request", type=Path, help="a training case's request.json (the built-in side's)")
    parser.add_argument("out", type=Path, help="the captured run's folder")
    parser.add_argument("--max-grad-norm", type=float, help="the Trainer's clipping (default: the case's clip_grad)")
    parser.add_argument("--as-shipped", action="store_true", help="leave transformers 5.3.0's second division of the "
                                                                   "loss by the accumulation steps in place")
    parser.add_argument("--unrecorded", action="store_true", help="train without the recorder")
    parser.add_argument("--final-state", type=Path, help="save the parameters and optimizer state at the end")
    parser.add_argument("--drop-grad", help="a parameter whose gradient is set to None after each accumulation")
    parser.add_argument("--state-from", type=Path, help="a state folder (python -m harness state-for) to start the "
                                                        "step after its step from")
    args = parser.parse_args()
    request = json.loads(args.request.read_text())
    model_config, train = request["config"]["model"], request["config"]["train"]

    # The user's model and data: here the case's checkpoint, loaded as the harness's runners load it.
    checkpoint = torch_env.load_inputs(request["checkpoint"], torch.device("cpu"))
    hf = hf_families.modeling(families.model_config(model_config))
    model = hf_model.build_model(hf, model_config, torch.float32, torch.device("cpu"), checkpoint,
                                 NameMap.load(model_config["family"], "hf"))
    if args.drop_grad:
        model.get_parameter(args.drop_grad).register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    data = [{"input_ids": checkpoint[f"step{step}.mb{mb}.input_ids"],
             "labels": checkpoint[f"step{step}.mb{mb}.labels"],
             "shift_labels": checkpoint[f"step{step}.mb{mb}.labels"]}
            for step in range(1, train["steps"] + 1) for mb in range(train["micro_batches"])]

    arguments = TrainingArguments(
        output_dir=str(args.out / "trainer"), use_cpu=True, report_to="none", save_strategy="no",
        per_device_train_batch_size=1, gradient_accumulation_steps=train["micro_batches"], max_steps=train["steps"],
        train_sampling_strategy="sequential", dataloader_num_workers=0, remove_unused_columns=False,
        optim="adamw_torch", learning_rate=train["lr"], weight_decay=train["weight_decay"],
        adam_beta1=train["betas"][0], adam_beta2=train["betas"][1], adam_epsilon=train["eps"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": train["min_lr"]},
        warmup_steps=train["warmup_steps"],
        max_grad_norm=train["clip_grad"] if args.max_grad_norm is None else args.max_grad_norm)
    trainer = Trainer(model=model, args=arguments, train_dataset=data)
    trainer.model_accepts_loss_kwargs = False
    if not args.as_shipped:  # transformers 5.3.0 hands accelerate its accumulation steps and accelerate's backward
        trainer.accelerator.gradient_accumulation_steps = 1  # divides the loss by them again (issue 45305, PR 45349)

    if not args.unrecorded:
        attach(trainer, args.out, model_config=model_config, state_from=args.state_from)  # the one line
    trainer.train()
    if args.final_state:
        save_file(final_state(trainer.model, trainer.optimizer), str(args.final_state))


def final_state(model, optimizer) -> dict:
    """Every parameter by name, every optimizer state tensor by its param index and key (torch's state_dict)."""
    state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"state.{i}.{key}": value.clone() for i, held in optimizer.state_dict()["state"].items()
                  for key, value in held.items() if isinstance(value, torch.Tensor)})
    return state


if __name__ == "__main__":
    main()
