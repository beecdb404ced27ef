"""The optimizers a training case trains with (``train.optimizer``, docs/training.md), one record each.

A record says what the optimizer is to the harness, framework-free: its own settings (a frozen dataclass, every field
defaulted, read from the case's ``train`` table), the per-parameter state a step writes (canonical quantity names:
``step{k}.<quantity>.<p>``), where each stack keeps that state (copied into meta.json), and how each stack builds it
through its own API: ``torch`` (hf_model), ``paddle`` (paddle_model) and ``megatron`` (megatron_model's
``OptimizerConfig``). Those builders import their framework inside the function: only runners call them. Its
``update`` is one step in float64 numpy, framework-free: what the truth's step must give.

Adding an optimizer: a module here with its settings, its record and its builders, listed in ``OPTIMIZERS``; cases
that name it (docs/contributing.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT = "adamw"  # what a case without train.optimizer trains with (every case before the records)


@dataclass(frozen=True)
class Optimizer:
    name: str  # train.optimizer
    label: str  # what reports and docs call it
    settings: type  # its settings: a frozen dataclass with `problem()`, `to_dict()` and `from_dict()`
    # its settings' train fields: name -> (accepted TOML types, default); `stack_fields` are choices of one stack's
    # implementation (hf_model's torch flags), the rest the optimizer's own numbers
    fields: Mapping[str, tuple[tuple[type, ...], Any]]
    stack_fields: Mapping[str, tuple[tuple[type, ...], Any]]
    state: tuple[str, ...]  # the per-parameter state a step writes, in the step's order (canonical quantity names)
    locations: Mapping[str, Mapping[str, str]]  # stack ("hf", "megatron", "paddle") -> state quantity -> where it is
    paddle_accumulators: Mapping[str, str]  # state quantity -> the name of Paddle's accumulator holding it
    # (settings, param groups, lr, weight_decay) -> (torch.optim optimizer, meta.json knobs)
    torch: Callable[..., tuple[Any, dict]]
    # (settings, scheduler, parameters, weight_decay, parameters exempt from decay, grad_clip) -> (optimizer, knobs,
    # how weight decay leaves the exempt ones out)
    paddle: Callable[..., tuple[Any, dict, str]]
    # settings -> (OptimizerConfig keyword arguments of this optimizer, what meta.json shows of them, why)
    megatron: Callable[[Any], tuple[dict, dict, str]]
    distributed_optimizer: bool  # whether Megatron's DistributedOptimizer takes it
    # (settings, param, grad, state before the step or None at the first, lr, weight_decay, step) -> (param, state):
    # one step in float64 numpy as torch documents the optimizer, the harness's own formula that the float64 truth's
    # update is checked against (harness.compare.train_truth); `grad` is the one applied (clipped already)
    update: Callable[..., tuple[Any, dict]]
    matrix: Mapping[str, tuple[dict, ...]]  # runner -> knob-matrix cells of its stack fields (--gate-matrix)

    def parse(self, values: dict):
        """Its settings from the case's values of its fields (each typed already), defaults for the rest."""
        given = {**{key: default for key, (_, default) in (*self.fields.items(), *self.stack_fields.items())},
                 **values}
        return self.settings.from_dict(given)


def optimizer(name: str) -> Optimizer:
    """The record of `name` (a request's or a caller's); a ValueError naming the known ones."""
    if name not in OPTIMIZERS:
        raise ValueError(f"no optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


from harness.optimizers import adamw, sgd  # noqa: E402  (their records use Optimizer, defined above)

OPTIMIZERS: dict[str, Optimizer] = {record.name: record for record in (adamw.ADAMW, sgd.SGD)}
