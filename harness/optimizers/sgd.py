"""SGD with momentum (no dampening, no Nesterov: what every stack's API gives by default and Megatron's can give).

One formula on all three stacks, with coupled (L2) weight decay: g' = g + wd·p, buf = g' at the first step and
buf·momentum + g' after, p = p - lr·buf. Each stack's own:
- hf_model: ``torch.optim.SGD`` (its for-loop, foreach and fused paths give the same bits on a CPU, measured);
- paddle_model: ``paddle.optimizer.Momentum``, whose fused kernel applies the decay itself (``l2_decay``) and keeps
  the buffer as the accumulator ``velocity`` (zeros at first: 0·momentum + g' is g'). Its CPU kernel rounds every
  product on its own where torch fuses two (g + wd·p and p - lr·buf as one FMA each), so Paddle's parameters part from
  torch's at every step with lr > 0, and its buffer too wherever weight decay is on (docs/training.md). Momentum has
  no ``apply_decay_param_fun`` and param groups would make ``ClipGradByGlobalNorm`` clip per group, so a parameter
  exempt from decay gets its own ``L2Decay(0.0)`` regularizer, which the kernel reads in place of the optimizer's;
- megatron_model: ``OptimizerConfig(optimizer="sgd", sgd_momentum=...)``, whose inner optimizer without Transformer
  Engine or Apex is ``torch.optim.SGD``; its 1-D parameters' ``wd_mult`` 0 reaches torch's param groups only through
  ``OptimizerParamScheduler`` (which the runner always builds). Megatron's ``DistributedOptimizer`` refuses it (it
  asserts Adam: distrib_optimizer.py).
A step writes one buffer per parameter: ``momentum_buffer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.optimizers import Optimizer


@dataclass(frozen=True)
class SGDSettings:
    momentum: float = 0.9  # Megatron's sgd_momentum default

    @property
    def record(self) -> Optimizer:
        return SGD

    def problem(self) -> tuple[str, str] | None:
        """(field, why) of the first setting that cannot be trained with, or None."""
        if not 0 < self.momentum < 1:
            return "momentum", "must be in (0, 1): without momentum torch keeps no buffer (plain SGD writes no state)"
        return None

    def to_dict(self) -> dict:
        return {"momentum": self.momentum}

    @classmethod
    def from_dict(cls, values: dict) -> SGDSettings:
        return cls(values["momentum"])


def torch_optimizer(settings: SGDSettings, groups: list, lr: float, weight_decay: float):
    import torch

    optimizer = torch.optim.SGD(groups, lr=lr, momentum=settings.momentum, dampening=0.0,
                                weight_decay=weight_decay, nesterov=False)
    return optimizer, {"SGD": {"value": {"lr": lr, "momentum": settings.momentum, "dampening": 0.0,
                                         "weight_decay": weight_decay, "nesterov": False},
                               "why": "torch.optim.SGD: coupled weight decay (g + wd·p, one FMA), the buffer g' at "
                                      "the first step, then buf·momentum + g'; p - lr·buf (one FMA)"}}


def paddle_optimizer(settings: SGDSettings, scheduler, parameters: list, weight_decay: float, exempt: list,
                     grad_clip):
    """`exempt`: the parameters weight decay leaves out, each given ``L2Decay(0.0)`` (see the module docstring)."""
    import paddle

    for param in exempt:
        param.regularizer = paddle.regularizer.L2Decay(0.0)
    optimizer = paddle.optimizer.Momentum(
        learning_rate=scheduler, momentum=settings.momentum, parameters=parameters, use_nesterov=False,
        weight_decay=weight_decay, grad_clip=grad_clip, multi_precision=False)
    return optimizer, {
        "Momentum": {"value": {"momentum": settings.momentum, "use_nesterov": False, "weight_decay": weight_decay,
                               "multi_precision": False},
                     "why": "paddle.optimizer.Momentum: coupled weight decay inside its momentum kernel (l2_decay), "
                            "every product rounded on its own (no FMA)"}}, (
        f"a regularizer L2Decay(0.0) on each of the {len(exempt)} 1-D parameters (Momentum has no "
        "apply_decay_param_fun; param groups would clip per group)" if exempt else
        "Paddle decays every parameter (the optimizer's weight_decay)")


def megatron_config(settings: SGDSettings) -> tuple[dict, dict, str]:
    return ({"optimizer": "sgd", "sgd_momentum": settings.momentum}, {"momentum": settings.momentum},
            "Megatron's SGD is torch.optim.SGD (coupled weight decay, no dampening, no Nesterov) without TE/Apex")


def update(settings: SGDSettings, param: np.ndarray, grad: np.ndarray, state: dict | None, lr: float,
           weight_decay: float, step: int) -> tuple[np.ndarray, dict]:
    """One step of SGD with momentum in float64 as torch.optim.SGD documents it (coupled decay, the buffer g' at the
    first step)."""
    decayed = grad + weight_decay * param
    buffer = decayed if state is None else settings.momentum * state["momentum_buffer"] + decayed
    return param - lr * buffer, {"momentum_buffer": buffer}


SGD = Optimizer(
    name="sgd", label="SGD with momentum", settings=SGDSettings,
    fields={"momentum": ((float,), 0.9)}, stack_fields={},
    state=("momentum_buffer",),
    locations={
        "hf": {"momentum_buffer": "torch.optim.SGD state[p]['momentum_buffer'], p the parameter or its fp32 master"},
        "megatron": {"momentum_buffer": "the inner torch.optim.SGD's state[main_param]['momentum_buffer']"},
        "paddle": {"momentum_buffer": "optimizer._accumulators['velocity'][param.name]"},
    },
    paddle_accumulators={"momentum_buffer": "velocity"},
    torch=torch_optimizer, paddle=paddle_optimizer, megatron=megatron_config, distributed_optimizer=False,
    update=update,
    matrix={},
)
