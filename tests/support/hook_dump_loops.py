"""A user's training loop with per-module md5 dump hooks (harness.attach.dump_hooks), on torch or Paddle, for
tests/test_hook_dumps.py (each in its own process, as a user's training is)::

    python tests/support/hook_dump_loops.py STACK OUT [--renamed] [--plant MODULE CALL] [--unhooked]
        [--record FOLDER [--name-map FILE] [--modules-at K ...] [--plant-grad PARAMETER STEP]]

The model (the same in both stacks, float32, CPU): a token embedding, a two-layer tanh MLP, a layer norm and a
vocabulary head, its weights drawn from numpy in a fixed order; 2 AdamW steps of 2 micro-batches of 8 random tokens,
the mean cross entropy over the micro-batches. ``--renamed`` builds it under other module names
(``harness.compare.hook_dumps`` pairs them through a name map). ``--plant MODULE CALL`` adds one ULP to the first
element of MODULE's output at its CALL-th forward (CALL 3 is step 2, micro-batch 0): a planted one-bit change, through
a forward hook registered before the dump's. ``--unhooked`` trains without the dump hooks. OUT/dumps/workerlog.0 is
the dump, OUT/state.npz the parameters after training.

``--record FOLDER`` records the loop with harness.attach's recorder as a model without a family record (issue 42,
item 3: tests/test_attach_own.py), in its own names or ``--name-map FILE``'s, with ``--modules-at K ...``;
``--plant-grad PARAMETER STEP`` adds one ULP to the first element of that parameter's gradient at that step (torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

VOCAB, WIDTH, HIDDEN, TOKENS, STEPS, MICRO_BATCHES, LR = 32, 16, 32, 8, 2, 2, 1e-2
NAMES = {"embed": "embedding", "mlp": "ffn", "up": "fc_in", "act": "tanh", "down": "fc_out", "norm": "final_norm",
         "head": "lm_head"}  # --renamed: each attribute's other name


def weights() -> list[np.ndarray]:
    """Embedding, up (weight, bias), down (weight, bias), head weight, as (in, out) matrices: Paddle's layout."""
    rng = np.random.default_rng(3)
    shapes = [(VOCAB, WIDTH), (WIDTH, HIDDEN), (HIDDEN,), (HIDDEN, WIDTH), (WIDTH,), (WIDTH, VOCAB)]
    return [rng.normal(0, 0.2, shape).astype(np.float32) for shape in shapes]


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [(rng.integers(0, VOCAB, (1, TOKENS)), rng.integers(0, VOCAB, (TOKENS,)))
            for _ in range(STEPS * MICRO_BATCHES)]


def named(renamed: bool):
    return (lambda name: NAMES[name]) if renamed else (lambda name: name)


def torch_model(renamed: bool):
    import torch

    n, (embed, up_w, up_b, down_w, down_b, head_w) = named(renamed), weights()
    mlp = torch.nn.Module()
    for attribute, layer in (("up", torch.nn.Linear(WIDTH, HIDDEN)), ("act", torch.nn.Tanh()),
                             ("down", torch.nn.Linear(HIDDEN, WIDTH))):
        setattr(mlp, n(attribute), layer)

    class Tiny(torch.nn.Module):
        def forward(self, ids):
            inner = getattr(self, n("mlp"))
            x = getattr(self, n("embed"))(ids)
            x = x + getattr(inner, n("down"))(getattr(inner, n("act"))(getattr(inner, n("up"))(x)))
            return getattr(self, n("head"))(getattr(self, n("norm"))(x))

    model = Tiny()
    for attribute, layer in (("embed", torch.nn.Embedding(VOCAB, WIDTH)), ("mlp", mlp),
                             ("norm", torch.nn.LayerNorm(WIDTH)), ("head", torch.nn.Linear(WIDTH, VOCAB, bias=False))):
        setattr(model, n(attribute), layer)
    with torch.no_grad():
        for parameter, value in ((getattr(model, n("embed")).weight, embed), (getattr(mlp, n("up")).weight, up_w.T),
                                 (getattr(mlp, n("up")).bias, up_b), (getattr(mlp, n("down")).weight, down_w.T),
                                 (getattr(mlp, n("down")).bias, down_b), (getattr(model, n("head")).weight, head_w.T)):
            parameter.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return model


def paddle_model(renamed: bool):
    import paddle

    n, (embed, up_w, up_b, down_w, down_b, head_w) = named(renamed), weights()
    mlp = paddle.nn.Layer()
    for attribute, layer in (("up", paddle.nn.Linear(WIDTH, HIDDEN)), ("act", paddle.nn.Tanh()),
                             ("down", paddle.nn.Linear(HIDDEN, WIDTH))):
        setattr(mlp, n(attribute), layer)

    class Tiny(paddle.nn.Layer):
        def forward(self, ids):
            inner = getattr(self, n("mlp"))
            x = getattr(self, n("embed"))(ids)
            x = x + getattr(inner, n("down"))(getattr(inner, n("act"))(getattr(inner, n("up"))(x)))
            return getattr(self, n("head"))(getattr(self, n("norm"))(x))

    model = Tiny()
    for attribute, layer in (("embed", paddle.nn.Embedding(VOCAB, WIDTH)), ("mlp", mlp),
                             ("norm", paddle.nn.LayerNorm(WIDTH)),
                             ("head", paddle.nn.Linear(WIDTH, VOCAB, bias_attr=False))):
        setattr(model, n(attribute), layer)
    for parameter, value in ((getattr(model, n("embed")).weight, embed), (getattr(mlp, n("up")).weight, up_w),
                             (getattr(mlp, n("up")).bias, up_b), (getattr(mlp, n("down")).weight, down_w),
                             (getattr(mlp, n("down")).bias, down_b), (getattr(model, n("head")).weight, head_w)):
        parameter.set_value(value)
    return model


def plant(module, call: int, stack, amount: float | None = None):
    """A forward hook adding one ULP (or `amount`) to the first element of the module's output at its `call`-th
    forward (the first tensor of a tuple output)."""
    seen = {"calls": 0}

    def hook(layer, inputs, output):
        seen["calls"] += 1
        if seen["calls"] != call:
            return None
        tensor = output[0] if isinstance(output, tuple) else output
        first = np.array(tensor.detach().flatten()[0].item(), dtype=np.float32)
        step = amount if amount is not None else float(np.nextafter(first, np.float32(np.inf)) - first)
        mask = np.zeros(tensor.shape, dtype=bool)
        mask.flat[0] = True
        planted = stack.where(stack.to_tensor(mask) if stack.__name__ == "paddle" else stack.from_numpy(mask),
                              tensor + step, tensor)
        return (planted, *output[1:]) if isinstance(output, tuple) else planted

    if stack.__name__ == "paddle":
        return module.register_forward_post_hook(hook)
    return module.register_forward_hook(hook)


def stack_of(name: str, renamed: bool) -> SimpleNamespace:
    """What differs between the two stacks' loops: the framework, the model, its optimizer, its modules by name, how a
    numpy array becomes a tensor and how the gradients are cleared. The loop itself (``train``) is one."""
    if name == "torch":
        import torch as framework
        model = torch_model(renamed)
        optimizer = framework.optim.AdamW(model.parameters(), lr=LR)
        return SimpleNamespace(framework=framework, model=model, optimizer=optimizer,
                               modules=dict(model.named_modules()), tensor=framework.from_numpy,
                               clear=optimizer.zero_grad, host=lambda p: p.detach().numpy())
    import paddle as framework
    model = paddle_model(renamed)
    optimizer = framework.optimizer.AdamW(learning_rate=LR, parameters=model.parameters())
    return SimpleNamespace(framework=framework, model=model, optimizer=optimizer,
                           modules=dict(model.named_sublayers()), tensor=framework.to_tensor,
                           clear=optimizer.clear_grad, host=lambda p: p.numpy())


def recorder_of(stack_name: str, stack, folder: Path, name_map: Path | None, modules_at: list[int]):
    """harness.attach's recorder of this model of its own (no family record): its own names, or the map's."""
    config = {"family": "own", **({"name_map": str(name_map)} if name_map else {})}
    if stack_name == "torch":
        from harness.attach.torch import StepRecorder
        return StepRecorder(folder, stack.model, stack.optimizer, config, modules_at=modules_at)
    from harness.attach.paddle import PaddleStepRecorder
    return PaddleStepRecorder(folder, stack.model, stack.optimizer, config, modules_at=modules_at)


def plant_in_grad(stack, parameter: str) -> None:
    """One ULP added to the first element of `parameter`'s accumulated gradient (torch)."""
    grad = dict(stack.model.named_parameters())[parameter].grad.view(-1)
    first = np.float32(grad[0].item())
    with stack.framework.no_grad():
        grad[0] = float(np.nextafter(first, np.float32(np.inf)))


def train(stack_name: str, out: Path, renamed: bool, planted: tuple[str, int] | None, hooked: bool,
          record: Path | None = None, name_map: Path | None = None, modules_at=(),
          planted_grad: tuple[str, int] | None = None) -> None:
    from harness.attach.dump_hooks import DumpHooks

    stack = stack_of(stack_name, renamed)
    if planted:
        plant(stack.modules[planted[0]], planted[1], stack.framework)
    hooks = DumpHooks(stack.model, out / "dumps" / "workerlog.0", side="PF" if stack_name == "paddle" else "MG") \
        if hooked else None
    recorder = recorder_of(stack_name, stack, record, name_map, list(modules_at)) if record else None
    data = batches()
    for step in range(1, STEPS + 1):
        losses = []
        for mb in range(MICRO_BATCHES):
            ids, labels = data[(step - 1) * MICRO_BATCHES + mb]
            logits = stack.model(stack.tensor(ids))[0]
            loss = stack.framework.nn.functional.cross_entropy(logits, stack.tensor(labels)) / MICRO_BATCHES
            loss.backward()
            losses.append(loss)
        if planted_grad and planted_grad[1] == step:
            plant_in_grad(stack, planted_grad[0])
        grads = recorder.grads() if recorder else None
        stack.optimizer.step()
        if recorder:
            recorder.record(step, losses, LR, grads)
        stack.clear()
    if hooks:
        hooks.close()
    if recorder:
        recorder.close()
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "state.npz", **{name: stack.host(p) for name, p in stack.model.named_parameters()})


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stack", choices=("torch", "paddle"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--renamed", action="store_true")
    parser.add_argument("--plant", nargs=2, metavar=("MODULE", "CALL"))
    parser.add_argument("--unhooked", action="store_true")
    parser.add_argument("--record", type=Path, metavar="FOLDER")
    parser.add_argument("--name-map", type=Path, metavar="FILE")
    parser.add_argument("--modules-at", type=int, nargs="*", default=[])
    parser.add_argument("--plant-grad", nargs=2, metavar=("PARAMETER", "STEP"))
    args = parser.parse_args(argv)
    planted = (args.plant[0], int(args.plant[1])) if args.plant else None
    planted_grad = (args.plant_grad[0], int(args.plant_grad[1])) if args.plant_grad else None
    train(args.stack, args.out, args.renamed, planted, not args.unhooked, args.record, args.name_map,
          args.modules_at, planted_grad)


if __name__ == "__main__":
    main(sys.argv[1:])
