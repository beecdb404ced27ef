"""AdamW (decoupled weight decay): the optimizer every training case trained with before the records, and the default.

Each stack's own: ``torch.optim.AdamW`` (hf_model; ``torch_adamw`` picks its foreach / fused flags, "default" passes
neither), ``paddle.optimizer.AdamW`` (paddle_model: eps scaled by sqrt(1 - beta2^t), the bias correction folded into
the lr, fp32 beta powers), Megatron-Core's ``OptimizerConfig(optimizer="adam")``, whose inner optimizer without
Transformer Engine or Apex is ``torch.optim.AdamW``. A step writes both moments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.optimizers import Optimizer

TORCH_ADAMW = {"default": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@dataclass(frozen=True)
class AdamWSettings:
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    torch_adamw: str = "default"  # hf_model: torch.optim.AdamW's foreach / fused flags

    @property
    def record(self) -> Optimizer:
        return ADAMW

    def problem(self) -> tuple[str, str] | None:
        """(field, why) of the first setting that cannot be trained with, or None."""
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                           for b in self.betas):
            return "betas", "must be two numbers in [0, 1): [beta1, beta2]"
        if not self.eps > 0:
            return "eps", "must be > 0"
        if self.torch_adamw not in TORCH_ADAMW:
            return "torch_adamw", f"must be one of {', '.join(TORCH_ADAMW)}"
        return None

    def to_dict(self) -> dict:
        return {"betas": list(self.betas), "eps": self.eps, "torch_adamw": self.torch_adamw}

    @classmethod
    def from_dict(cls, values: dict) -> AdamWSettings:
        betas = values["betas"]
        return cls(tuple(float(b) if isinstance(b, int) and not isinstance(b, bool) else b for b in betas),
                   values["eps"], values["torch_adamw"])


def torch_optimizer(settings: AdamWSettings, groups: list, lr: float, weight_decay: float):
    import torch

    flags = TORCH_ADAMW[settings.torch_adamw]
    beta1, beta2 = settings.betas
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=settings.eps, weight_decay=weight_decay,
                                  **flags)
    return optimizer, {"AdamW": {"value": {"lr": lr, "betas": [beta1, beta2], "eps": settings.eps,
                                           "weight_decay": weight_decay, **flags},
                                 "why": f"torch.optim.AdamW; torch_adamw = {settings.torch_adamw!r}"}}


def paddle_optimizer(settings: AdamWSettings, scheduler, parameters: list, weight_decay: float, exempt: list,
                     grad_clip):
    """`exempt`: the parameters weight decay leaves out (``apply_decay_param_fun``), all decay when empty. Returns
    the optimizer, its knobs and how weight decay leaves `exempt` out."""
    import paddle

    beta1, beta2 = settings.betas
    names = {p.name for p in exempt}
    decay = (lambda name: name not in names) if exempt else None
    optimizer = paddle.optimizer.AdamW(
        learning_rate=scheduler, beta1=beta1, beta2=beta2, epsilon=settings.eps, parameters=parameters,
        weight_decay=weight_decay, apply_decay_param_fun=decay, grad_clip=grad_clip, multi_precision=False)
    return optimizer, {
        "AdamW": {"value": {"beta1": beta1, "beta2": beta2, "epsilon": settings.eps, "weight_decay": weight_decay,
                            "multi_precision": False},
                  "why": "paddle.optimizer.AdamW (decoupled weight decay, eps scaled by sqrt(1 - beta2^t))"}}, (
        f"apply_decay_param_fun leaves the {len(exempt)} 1-D parameters out" if exempt else
        "Paddle decays every parameter (no apply_decay_param_fun)")


def megatron_config(settings: AdamWSettings) -> tuple[dict, dict, str]:
    beta1, beta2 = settings.betas
    return ({"optimizer": "adam", "adam_beta1": beta1, "adam_beta2": beta2, "adam_eps": settings.eps},
            {"betas": list(settings.betas), "eps": settings.eps},
            "Megatron's Adam is torch.optim.AdamW (decoupled weight decay) without TE/Apex")


def update(settings: AdamWSettings, param: np.ndarray, grad: np.ndarray, state: dict | None, lr: float,
           weight_decay: float, step: int) -> tuple[np.ndarray, dict]:
    """One AdamW step in float64 as torch.optim.AdamW documents it (decoupled decay first, bias-corrected moments;
    eps added to sqrt(v_hat))."""
    beta1, beta2 = settings.betas
    exp_avg, exp_avg_sq = (state["exp_avg"], state["exp_avg_sq"]) if state else (np.zeros_like(param),) * 2
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = np.sqrt(exp_avg_sq) / np.sqrt(1 - beta2 ** step) + settings.eps
    param = param - lr / (1 - beta1 ** step) * exp_avg / denom
    return param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


ADAMW = Optimizer(
    name="adamw", label="AdamW", settings=AdamWSettings,
    fields={"betas": ((list,), [0.9, 0.95]), "eps": ((float,), 1e-8)},
    stack_fields={"torch_adamw": ((str,), "default")},
    state=("exp_avg", "exp_avg_sq"),
    locations={
        "hf": {"exp_avg": "torch.optim.AdamW state[p]['exp_avg'], p the parameter or its fp32 master",
               "exp_avg_sq": "torch.optim.AdamW state[p]['exp_avg_sq']"},
        "megatron": {"exp_avg": "the inner torch.optim.AdamW's state[main_param]['exp_avg'] (distributed optimizer: "
                                "the shard's, viewed in the parameter's shape)",
                     "exp_avg_sq": "the inner torch.optim.AdamW's state[main_param]['exp_avg_sq']"},
        "paddle": {"exp_avg": "optimizer._accumulators['moment1'][param.name]",
                   "exp_avg_sq": "optimizer._accumulators['moment2'][param.name]"},
    },
    paddle_accumulators={"exp_avg": "moment1", "exp_avg_sq": "moment2"},
    torch=torch_optimizer, paddle=paddle_optimizer, megatron=megatron_config, distributed_optimizer=True,
    update=update,
    matrix={"hf_model": ({"torch_adamw": "foreach"}, {"torch_adamw": "fused"})},
)
