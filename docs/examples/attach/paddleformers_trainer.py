"""A user's PaddleFormers ``Trainer`` run with the harness's recorder attached (docs/attach.md; run by
tests/test_attach_paddleformers.py)::

    python docs/examples/attach/paddleformers_trainer.py REPORT/b-paddle_model/request.json OUT

It trains the model and data of a registry training case (its request.json names the checkpoint and settings) with
``paddleformers.trainer.Trainer`` on the CPU, float32, and adds ``harness.attach.paddleformers.attach`` (one line).
The model is PaddleFormers' ``DeepseekV3ForCausalLM``, built and loaded as the harness's paddle_model runner builds it
(PaddleFormers imports PaddleFleet's GPU package ``paddlefleet_ops``: a stand-in answers it on a CPU). What it sets:
``dataloader_shuffle=False`` (the case's micro-batches in order), ``amp_master_grad=False`` (float32 has no amp),
and on a CPU ``paddle.device.synchronize`` as a no-op (PaddleFormers calls it before scaling the accumulated gradients;
Paddle raises on a CPU device). The optimizer (AdamW, norms and biases undecayed), its lr schedule
(``lr_scheduler_type="cosine"`` with ``min_lr``), the clipping (``ClipGradByGlobalNorm``) and the gradient accumulation
(each micro-batch's loss backpropagated, the summed gradients scaled by 1 / accumulation steps) are the Trainer's own.
"""

import argparse
import json
from pathlib import Path

from harness.runners.paddle import paddlefleet_ops_shim

paddlefleet_ops_shim.install()  # before PaddleFormers imports: PaddleFleet's GPU package is not on a CPU machine

import paddle  # noqa: E402
from paddleformers.trainer import Trainer, TrainingArguments  # noqa: E402

from harness.attach.paddleformers import attach  # noqa: E402
from harness.families import model_config  # noqa: E402
from harness.runners.paddle import families  # noqa: E402
from harness.runners.paddle import model as paddle_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("request", type=Path, help="a training case's request.json (the built-in side's)")
    parser.add_argument("out", type=Path, help="the captured run's folder")
    args = parser.parse_args()
    request = json.loads(args.request.read_text())
    m, train = request["config"]["model"], request["config"]["train"]

    paddle.set_device("cpu")
    families.classes(model_config(m))  # PaddleFormers' classes, imported with the stand-ins the family needs
    model, checkpoint, _, _ = paddle_model.build_model(m, "float32", request["checkpoint"])
    data = [{"input_ids": checkpoint[f"step{step}.mb{mb}.input_ids"],
             "labels": checkpoint[f"step{step}.mb{mb}.labels"]}
            for step in range(1, train["steps"] + 1) for mb in range(train["micro_batches"])]
    arguments = TrainingArguments(
        output_dir=str(args.out / "trainer"), device="cpu", report_to="none", save_strategy="no",
        per_device_train_batch_size=1, gradient_accumulation_steps=train["micro_batches"], max_steps=train["steps"],
        dataloader_shuffle=False, amp_master_grad=False, learning_rate=train["lr"], min_lr=train["min_lr"],
        lr_scheduler_type="cosine", warmup_steps=train["warmup_steps"], weight_decay=train["weight_decay"],
        adam_beta1=train["betas"][0], adam_beta2=train["betas"][1], adam_epsilon=train["eps"],
        max_grad_norm=train["clip_grad"], logging_steps=1)
    paddle.device.synchronize = lambda *_, **__: None  # a CPU has nothing to wait for; Paddle raises instead
    trainer = Trainer(model=model, args=arguments, train_dataset=data)

    attach(trainer, args.out, model_config=m)  # the one line the harness asks for
    trainer.train()


if __name__ == "__main__":
    main()
