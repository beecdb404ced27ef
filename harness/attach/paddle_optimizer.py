"""What a user's Paddle optimizer does beyond its record (``harness.optimizers``: AdamW, SGD with momentum), found when
the recorder is built: a run recorded as plain AdamW or Momentum while its optimizer also did something else would be
compared as if it had not (issue 40, finding 10).

Each of these changes the update the record describes, so the recorder refuses it, naming the setting and its value:
AdamW's ``lazy_mode``, ``amsgrad``, ``lr_ratio``; Momentum's ``use_nesterov``, ``rescale_grad``,
``use_multi_tensor`` (another kernel); per-group settings (param groups as dicts); a regularizer on a parameter
(coupled into its gradient; for Momentum ``L2Decay(0.0)`` is how a parameter is left undecayed, the runner's
``not_1d``) or the optimizer's other than L2; a ``grad_clip`` other than ``ClipGradByGlobalNorm`` (the clip the
observer reads), or one with ``auto_skip_clip`` (no factor below the norm), or one whose norm is not the stated
``clip_grad``; and for bfloat16 / float16 parameters ``multi_precision`` (fp32 masters the recorder does not read)
and ``use_lowprecision_moment``. A class other than ``paddle.optimizer.AdamW`` / ``Momentum`` themselves (a subclass
may change the update) is refused too.
"""

from __future__ import annotations

from harness.runners.paddle.model import paddle

# the record's optimizer class -> its attributes that change the update, and the value the record describes
FLAGS = {"AdamW": {"_lazy_mode": False, "_amsgrad": False, "_lr_ratio": None},
         "Momentum": {"_use_nesterov": False, "_rescale_grad": 1.0, "_use_multi_tensor": False}}
LOW_PRECISION = ("bfloat16", "float16")


def low_precision(params) -> list:
    return [p for p in params if dtype_of(p) in LOW_PRECISION]


def dtype_of(param) -> str:
    return str(param.dtype).removeprefix("paddle.")


def refusals(optimizer, params: list, stated: dict) -> list[str]:
    """Every setting of `optimizer` (over its `params`) the record does not describe, each as 'setting = value'."""
    kind = type(optimizer).__name__
    found = []
    if type(optimizer) is not getattr(paddle.optimizer, kind, None):
        found.append(f"optimizer class {type(optimizer).__module__}.{kind} (not paddle.optimizer.{kind} itself)")
    found += [f"{kind}.{flag.lstrip('_')} = {getattr(optimizer, flag, plain)!r}"
              for flag, plain in FLAGS.get(kind, {}).items() if getattr(optimizer, flag, plain) != plain]
    found += [f"a param group's own {key} = {value!r}" for key, value in _group_settings(optimizer)]
    if getattr(optimizer, "regularization", None) is not None:
        found.append(f"{kind} weight_decay = {type(optimizer.regularization).__name__} (coupled into the gradients)")
    found += [f"parameter {p.name}: regularizer = {type(p.regularizer).__name__}"
              f"({getattr(p.regularizer, '_coeff', '')})" for p in params if not _plain(optimizer, p)]
    found += _clip(optimizer._grad_clip, stated)
    low = low_precision(params)
    if low and getattr(optimizer, "_multi_precision", False):
        found.append(f"{kind}.multi_precision = True for {dtype_of(low[0])} parameters (fp32 masters: the recorder "
                     "does not read them)")
    if low and getattr(optimizer, "_use_lowprecision_moment", False):
        found.append(f"{kind}.use_lowprecision_moment = True")
    return found


def undecayed(optimizer, param) -> bool:
    """Whether weight decay leaves `param` out: AdamW's ``apply_decay_param_fun``, Momentum's ``L2Decay(0.0)``."""
    if type(optimizer).__name__ == "Momentum":
        return _regularizer_coeff(param) == 0.0
    decide = getattr(optimizer, "_apply_decay_param_fun", None)
    return decide is not None and not decide(param.name)


def weight_decay(optimizer) -> float:
    if type(optimizer).__name__ == "Momentum":
        return float(optimizer._regularization_coeff) if optimizer._regularization_method else 0.0
    return float(optimizer._weight_decay or 0.0)


def _group_settings(optimizer) -> list[tuple[str, object]]:
    """The settings of param groups (dicts) that are not the optimizer's own (Paddle fills a group's missing ones in
    from ``_default_dict``)."""
    default = getattr(optimizer, "_default_dict", {})
    return [(key, value) for group in optimizer._param_groups or [] if isinstance(group, dict)
            for key, value in group.items()
            if key != "params" and (key not in default or value is not default[key] and value != default[key])]


def _plain(optimizer, param) -> bool:
    """A parameter without a regularizer, or (Momentum) left undecayed by ``L2Decay(0.0)``."""
    regularizer = getattr(param, "regularizer", None)
    return regularizer is None or type(optimizer).__name__ == "Momentum" and _regularizer_coeff(param) == 0.0


def _regularizer_coeff(param) -> float | None:
    regularizer = getattr(param, "regularizer", None)
    if isinstance(regularizer, paddle.regularizer.L2Decay):
        return float(regularizer._coeff)
    return None


def _clip(clip, stated: dict) -> list[str]:
    if clip is None:
        return []
    if type(clip) is not paddle.nn.ClipGradByGlobalNorm:
        return [f"grad_clip = {type(clip).__name__} (the recorder reads ClipGradByGlobalNorm's norm and factor)"]
    found = ["ClipGradByGlobalNorm.auto_skip_clip = True (no factor below the norm)"] if clip.auto_skip_clip else []
    if "clip_grad" in stated and float(stated["clip_grad"]) != clip.clip_norm:
        found.append(f"ClipGradByGlobalNorm.clip_norm = {clip.clip_norm}, stated clip_grad = {stated['clip_grad']}")
    return found
