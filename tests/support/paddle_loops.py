"""Users' Paddle training runs, with and without the harness's recorder, for tests/test_attach_paddle.py (each in its
own process, as a user's training is)::

    python tests/support/paddle_loops.py MODE OUT

The model is PaddleFormers' tiny GLM-4.5 MoE (tests/support/train.py's TINY_GLM, float32, CPU, weights as
construction draws them after ``paddle.seed(0)``), trained 3 steps of 2 micro-batches of 8 random tokens with Paddle
AdamW (weight decay 0.1, 1-D parameters undecayed) and ``ClipGradByGlobalNorm(1.0)``. At 8 tokens most of its 16
routed experts get none, and Paddle's GLM MoE never calls those: they have no gradient (``param.grad`` None).

MODE:
- ``loop`` / ``loop-recorded``: a dygraph loop, bare or with ``PaddleStepRecorder`` (OUT/run);
- ``loop-modules``: recorded with ``modules_at=[2]`` (every module's output and output gradient at step 2);
- ``loop-broken``: recorded, with the run's steps folder replaced by a file after step 1 (a disk that goes away):
  recording fails at step 2;
- ``trainer`` / ``trainer-recorded``: PaddleFormers' ``Trainer``, bare or with ``attach`` (one line);
- ``loop-refed STATE`` / ``trainer-refed STATE``: recorded, and re-fed from the state folder STATE (``python -m harness
  state-for``) after the step it holds the state of (``load_state``; the callback's ``state_from``);
- ``refusals``: recorders built over optimizers and models the recorder cannot describe; each one's error;
- ``ranks``: under ``paddle.distributed.launch --nproc_per_node 2``: a recorder built on each rank; its error.

OUT/state.npz: every parameter (``param.<name>``) and optimizer accumulator (``<accumulator>.<param>``) after the
run; OUT/result.json what else the mode tells (parameters without a gradient at step 1, warnings, errors).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

from harness.runners.paddle import paddlefleet_ops_shim

paddlefleet_ops_shim.install()  # before PaddleFormers imports: PaddleFleet's GPU package is not on a CPU machine

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from harness.attach.paddle import PaddleStepRecorder  # noqa: E402
from harness.families import model_config  # noqa: E402
from harness.runners.paddle.model import fresh_model  # noqa: E402
from harness.runners.paddle.train import clip_norm_and_factor  # noqa: E402
from tests.support.train import TINY_GLM  # noqa: E402

STEPS, MICRO_BATCHES, TOKENS = 3, 2, 8


def batches() -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"input_ids": rng.integers(0, TINY_GLM["vocab_size"], TOKENS),
             "labels": rng.integers(0, TINY_GLM["vocab_size"], TOKENS)} for _ in range(STEPS * MICRO_BATCHES)]


def adamw(model, **options):
    one_d = {p.name for p in model.parameters() if len(p.shape) <= 1}
    settings = {"learning_rate": 1e-3, "parameters": model.parameters(), "weight_decay": 0.1,
                "apply_decay_param_fun": lambda name: name not in one_d,
                "grad_clip": paddle.nn.ClipGradByGlobalNorm(1.0), **options}
    return paddle.optimizer.AdamW(**settings)


def loop(out: Path, recorded: bool, broken: bool = False, modules_at=(), state_from: Path | None = None) -> dict:
    model = fresh_model(model_config(TINY_GLM), "float32")
    optimizer = adamw(model)
    recorder = PaddleStepRecorder(out / "run", model, optimizer, TINY_GLM, stated={"clip_grad": 1.0},
                                  modules_at=modules_at) if recorded else None
    data, without = batches(), {}
    for step in range(1, STEPS + 1):
        losses = []
        for mb in range(MICRO_BATCHES):
            batch = data[(step - 1) * MICRO_BATCHES + mb]
            output = model(input_ids=paddle.to_tensor(batch["input_ids"].reshape(1, -1)),
                           labels=paddle.to_tensor(batch["labels"].reshape(1, -1)), return_dict=True)
            scaled = output.loss / MICRO_BATCHES
            scaled.backward()
            losses.append(scaled.detach())
        without[step] = [name for name, p in model.named_parameters() if p.grad is None]
        lr = optimizer.get_lr()
        if recorder is None:
            optimizer.step()
        else:
            grads = recorder.grads()
            with clip_norm_and_factor(optimizer._grad_clip) as seen:
                optimizer.step()
            recorder.record(step, losses, lr, grads, seen["sqrt"][0], seen["divide"][0])
            if state_from and step == json.loads((state_from / "state.json").read_text())["step"]:
                recorder.load_state(state_from)
            if broken and step == 1:
                shutil.rmtree(out / "run" / "steps")
                (out / "run" / "steps").write_text("not a folder")
        optimizer.clear_grad()
    if recorder is not None:
        recorder.close()
    save_state(out, model, optimizer)
    return {"without_gradient": without}


def trainer(out: Path, recorded: bool, state_from: Path | None = None) -> dict:
    from paddleformers.trainer import Trainer, TrainingArguments

    from harness.attach.paddleformers import attach

    model = fresh_model(model_config(TINY_GLM), "float32")
    arguments = TrainingArguments(
        output_dir=str(out / "trainer"), device="cpu", report_to="none", save_strategy="no",
        per_device_train_batch_size=1, gradient_accumulation_steps=MICRO_BATCHES, max_steps=STEPS,
        dataloader_shuffle=False, amp_master_grad=False, learning_rate=1e-3, min_lr=1e-4, lr_scheduler_type="cosine",
        weight_decay=0.1, max_grad_norm=1.0, logging_steps=1)
    paddle.device.synchronize = lambda *_, **__: None  # a CPU has nothing to wait for; Paddle raises instead
    run = Trainer(model=model, args=arguments, train_dataset=batches())
    if recorded:
        attach(run, out / "run", model_config=TINY_GLM, state_from=state_from)
    run.train()
    save_state(out, run.model, run.optimizer)
    return {"optimizer_class": f"{type(run.optimizer).__module__}.{type(run.optimizer).__name__}"}


def save_state(out: Path, model, optimizer) -> None:
    state = {f"param.{name}": p.numpy() for name, p in model.named_parameters()}
    state.update({f"{kind}.{name}": t.numpy() for kind, held in optimizer._accumulators.items()
                  for name, t in held.items()})
    np.savez(out / "state.npz", **state)


def refusals(out: Path) -> dict:
    """Each case: the AttachError's message, or None where the recorder was built."""
    m = model_config(TINY_GLM)
    model = fresh_model(m, "float32")
    one_d = [p for p in model.parameters() if len(p.shape) <= 1]
    regularized = fresh_model(m, "float32")
    regularized.parameters()[0].regularizer = paddle.regularizer.L2Decay(0.01)

    class Wrapped(paddle.nn.Layer):  # the model under another name (as paddle.DataParallel's _layers)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    with_head = fresh_model(m, "float32")
    with_head.extra_head = paddle.nn.Linear(4, 4)  # a trained parameter the family's name map does not know
    frozen_head = fresh_model(m, "float32")
    frozen_head.extra_head = paddle.nn.Linear(4, 4)
    for p in frozen_head.extra_head.parameters():
        p.stop_gradient = True
    bf16 = fresh_model(m, "float32").to(dtype="bfloat16")
    marked_fleet = fresh_model(m, "float32")
    marked_fleet.is_fleet = True  # read through [paddlefleet]: GPTModel's names, which the dygraph model has not
    groups = [{"params": [p for p in model.parameters() if len(p.shape) > 1]},
              {"params": one_d, "weight_decay": 0.0}]
    momentum = paddle.optimizer.Momentum
    cases = {
        "plain AdamW": (model, lambda: adamw(model), {}),
        "lazy_mode": (model, lambda: adamw(model, lazy_mode=True), {}),
        "amsgrad": (model, lambda: adamw(model, amsgrad=True), {}),
        "param groups": (model, lambda: adamw(model, parameters=groups), {}),
        "a parameter's regularizer": (regularized, lambda: adamw(regularized), {}),
        "ClipGradByNorm": (model, lambda: adamw(model, grad_clip=paddle.nn.ClipGradByNorm(1.0)), {}),
        "auto_skip_clip": (model, lambda: adamw(model, grad_clip=paddle.nn.ClipGradByGlobalNorm(
            1.0, auto_skip_clip=True)), {}),
        "clip_grad stated otherwise": (model, lambda: adamw(model), {"clip_grad": 0.5}),
        "use_nesterov": (model, lambda: momentum(parameters=model.parameters(), use_nesterov=True), {}),
        "rescale_grad": (model, lambda: momentum(parameters=model.parameters(), rescale_grad=0.5), {}),
        "L1Decay": (model, lambda: momentum(parameters=model.parameters(),
                                            weight_decay=paddle.regularizer.L1Decay(0.01)), {}),
        "plain Momentum": (model, lambda: momentum(parameters=model.parameters(), weight_decay=0.01), {}),
        "an unmapped trained parameter": (with_head, lambda: adamw(with_head), {}),
        "an unmapped frozen parameter": (frozen_head, lambda: adamw(frozen_head), {}),
        "a wrapped model": (Wrapped(model), lambda: adamw(model), {}),
        "a model marked is_fleet": (marked_fleet, lambda: adamw(marked_fleet), {}),
        "bf16 with masters": (bf16, lambda: adamw(bf16, multi_precision=True), {}),
    }
    found = {}
    for name, (layer, make, stated) in cases.items():
        try:
            PaddleStepRecorder(out / name.replace(" ", "_"), layer, make(), TINY_GLM, stated=stated)
            found[name] = None
        except ValueError as error:  # AttachError
            found[name] = f"{type(error).__name__}: {error}"
    found["bf16 without masters: meta.json"] = recorded_once(out / "bf16", bf16, adamw(bf16))  # recorded, and said
    undecayed = fresh_model(m, "float32")
    for p in undecayed.parameters():  # the runner's not_1d for Momentum (harness/optimizers/sgd.py)
        p.regularizer = paddle.regularizer.L2Decay(0.0) if len(p.shape) <= 1 else None
    found["Momentum, 1-D undecayed: meta.json"] = recorded_once(
        out / "momentum", undecayed, momentum(parameters=undecayed.parameters(), momentum=0.9, weight_decay=0.01))
    return found


def recorded_once(folder: Path, model, optimizer) -> dict:
    """meta.json after one step recorded as the model and optimizer are (no step taken: Paddle has no bf16 matmul on a
    CPU, and the description is what is looked at)."""
    recorder = PaddleStepRecorder(folder, model, optimizer, TINY_GLM)
    recorder.record(1, [paddle.to_tensor(0.0)], 1e-3, recorder.grads())
    return json.loads((folder / "meta.json").read_text())


def ranks(out: Path) -> dict:
    paddle.distributed.init_parallel_env()
    rank = paddle.distributed.get_rank()
    model = fresh_model(model_config(TINY_GLM), "float32")
    try:
        PaddleStepRecorder(out / "run", model, adamw(model), TINY_GLM)
        error = None
    except ValueError as refused:
        error = f"{type(refused).__name__}: {refused}"
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "error": error}))
    return {}


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    state_from = Path(sys.argv[3]) if mode.endswith("-refed") else None
    out.mkdir(parents=True, exist_ok=True)
    paddle.set_device("cpu")
    warnings = Warnings()
    logging.getLogger("harness.attach").addHandler(warnings)
    if mode.startswith("loop"):
        result = loop(out, recorded=mode != "loop", broken=mode == "loop-broken",
                      modules_at=[2] if mode == "loop-modules" else (), state_from=state_from)
    elif mode.startswith("trainer"):
        result = trainer(out, recorded=mode != "trainer", state_from=state_from)
    else:
        result = {"refusals": refusals, "ranks": ranks}[mode](out)
    if mode != "ranks":
        (out / "result.json").write_text(json.dumps({**result, "warnings": warnings.messages}, default=str))


if __name__ == "__main__":
    main()
