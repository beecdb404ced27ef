"""The float64 truth of a training case, held to the harness's own formula, and each side held to the truth
(docs/training.md, "The truth's own check" and "Farther from the truth than expected").

- ``check_truth``: at every step whose state before it is on disk, the truth's lr against the case's schedule, its
  gradient norm and clip factor against its gradients, and its optimizer state and parameters against the
  optimizer's float64 ``update`` (``harness.optimizers``) from its own state before the step. A truth that does not
  follow the formula (a fault in its environment, a changed library) is unreliable at that step: the report says
  where, no side is judged against it there, and the run is ERROR (harness.levels.train).
- ``farther``: per step, quantity and side, how far the side's step is from the truth's step, relative to the
  truth's step (``step_error``); beyond ``FARTHER`` the step is flagged for that side.

The state before step 1 is the checkpoint's (zeros for the optimizer's state); a parameter whose canonical name the
checkpoint does not hold as is (a fused tensor) is judged from step 2 on.
"""

from __future__ import annotations

import math

import numpy as np
from safetensors import safe_open

from harness.case.ops import train_state_names
from harness.case.registry import Case
from harness.case.train_settings import TrainSettings
from harness.run.orchestrate import SideResult
from harness.run.steps import step_file

# Formula against truth, relative to the tensor's step (parameters) or its largest value (the rest): both are float64
# evaluations of one formula in another order; a fault is a relative error of order 1 (the tiny 3-step cases of
# tests/test_train_truth.py at 16 tokens, 2026-12-06: at most 1.3e-13 clean, 9 with a 10x lr).
TRUTH_AGREEMENT = 1e-9
# A side's step farther from the truth's than half the truth's step is flagged. Measured on the tiny 3-step
# DeepSeek-V3 case at 16 tokens, Megatron-Core against HF, AVX-512+AMX Xeon, 2026-12-06: clean at most 0.027
# (float32: Megatron's own weight decay and routing-bias choices) and 0.032 (bfloat16, on the masters; the bf16
# parameters' own rounding gives up to 0.21, so a side with fp32 masters is judged on its masters); 10x its lr at
# step 3 gives 9.0 on the planted side, 0.90 on the others when the truth itself is planted (docs/training.md).
FARTHER = 0.5
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: max_norm / (total_norm + 1e-6)


def scheduled_lr(train: TrainSettings, step: int) -> float:
    """The lr of step `step` (1-based) as the case's schedule gives it: HF's LambdaLR of the truth's stack, linear
    warmup from 0, then cosine down to min_lr over decay_steps (or constant), evaluated at the step count before the
    step (transformers.optimization's formula)."""
    done = step - 1
    if done < train.warmup_steps:
        return train.lr * (float(done) / float(max(1, train.warmup_steps)))
    if train.decay_style == "constant":
        return train.lr * 1.0
    progress = float(done - train.warmup_steps) / float(max(1, train.decay_steps - train.warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return train.lr * max(0, factor * (1 - train.min_lr / train.lr) + train.min_lr / train.lr)


def check_truth(case: Case, truth: SideResult, initial: dict[str, np.ndarray]) -> dict:
    """{"checked": steps, "unreliable": {step: why}, "not_checked": {step: why}, "largest_relative_error"} (steps as
    strings: report.json).
    `initial`: the checkpoint's tensors (the state before step 1)."""
    out = truth_check(case)
    for step in range(1, case.train.steps + 1):
        check_truth_step(case, truth, initial, step, out)
    return out


def truth_check(case: Case) -> dict:
    """``check_truth``'s answer before any step is checked."""
    record = case.train.record
    return {"formula": f"{record.label} in float64 (harness.optimizers.{record.name}.update), the case's schedule",
            "tolerance": TRUTH_AGREEMENT, "checked": [], "unreliable": {}, "not_checked": {}}


def check_truth_step(case: Case, truth: SideResult, initial: dict[str, np.ndarray], step: int, out: dict,
                     states=None) -> None:
    """Step `step` of ``check_truth``, into `out` (``truth_check``'s): it reads the truth's steps `step` - 1 and
    `step` (through `states`, ``_states`` unless given: ``held_states`` of the step before, its file given back)."""
    states = states or _states
    names = train_state_names(case.config["model"])
    before, now = states(truth, step - 1, initial), states(truth, step, initial)
    if now is None or before is None:
        out["not_checked"][str(step)] = f"the truth kept no tensors of step {step if now is None else step - 1}"
        return
    problem, worst = _truth_step(case.train, names, step, before, now)
    out["checked"].append(step)
    out["largest_relative_error"] = max(out.get("largest_relative_error", 0.0), worst)
    if problem:
        out["unreliable"][str(step)] = problem


def _truth_step(train: TrainSettings, names, step: int, before, now) -> tuple[str, float]:
    """(the first way the truth's step `step` departs from the formula or '', the largest relative error seen)."""
    lr = scheduled_lr(train, step)
    reported = float(now("lr"))
    if not _close(reported, lr, abs(lr)):
        return f"step{step}.lr is {reported!r}, the case's schedule gives {lr!r}", math.inf
    grads = {name: now(f"grad.{name}") for name, _ in names}
    grads = {name: grad for name, grad in grads.items() if grad is not None}  # a stack writes every one; else skip
    coeff = 1.0
    if train.clip_grad > 0:
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        coeff = min(train.clip_grad / (norm + CLIP_EPS), 1.0)
        for scalar, value in (("grad_norm", norm), ("clip_coeff", coeff)):
            got = float(now(scalar))
            if not _close(got, value, abs(value)):
                return f"step{step}.{scalar} is {got!r}, its gradients give {value!r}", math.inf
    record, worst = train.record, 0.0
    for name, shape in names:
        param = before(f"param.{name}")
        if param is None or name not in grads:  # a fused parameter before step 1: no state to start from
            continue
        state = None if step == 1 else {q: before(f"{q}.{name}") for q in record.state}
        decay = train.weight_decay if train.weight_decay_params != "not_1d" or len(shape) > 1 else 0.0
        want, want_state = record.update(train.optimizer, param, grads[name] * coeff, state, lr, decay, step)
        for quantity, value in (*want_state.items(), ("param", want)):
            got = now(f"{quantity}.{name}")
            scale = np.max(np.abs(want - param)) if quantity == "param" else np.max(np.abs(value))
            error = float(np.max(np.abs(got - value)))
            relative = error / float(scale) if scale else (0.0 if error == 0 else math.inf)
            worst = max(worst, relative)
            if relative > TRUTH_AGREEMENT:
                return (f"step{step}.{quantity}.{name} is {relative:.3g} (relative) from the formula's "
                        f"(tolerance {TRUTH_AGREEMENT:g})"), worst
    return "", worst


def _close(got: float, want: float, scale: float) -> bool:
    return abs(got - want) <= TRUTH_AGREEMENT * scale if scale else got == want


def farther(case: Case, pair: list[SideResult], truth: SideResult, initial: dict[str, np.ndarray],
            skipped: set[int]) -> tuple[dict, list[dict]]:
    """({step: {quantity: {label: step error}}}, the flags: {step, quantity, side, runner, error} beyond
    ``FARTHER``). Steps in `skipped` (the truth unreliable there) and steps whose state before is not on disk for a
    side are left out."""
    errors, flags = {}, []
    for step in range(1, case.train.steps + 1):
        if step not in skipped:
            farther_step(case, pair, truth, initial, step, errors, flags)
    return errors, flags


def farther_step(case: Case, pair: list[SideResult], truth: SideResult, initial: dict[str, np.ndarray], step: int,
                 errors: dict, flags: list[dict], states=None) -> None:
    """Step `step` of ``farther``, into `errors` and `flags`: it reads each run's steps `step` - 1 and `step` (through
    `states`, as ``check_truth_step``)."""
    states = states or _states
    names = [name for name, _ in train_state_names(case.config["model"])]
    quantities = ("grad", *case.train.record.state)
    truth_now, truth_before = states(truth, step, initial), states(truth, step - 1, initial)
    if truth_now is None or truth_before is None:
        return
    for side in pair:
        now, before = states(side, step, initial), states(side, step - 1, initial)
        if now is None or before is None:
            continue
        moved = "master" if now(f"master.{names[0]}") is not None else "param"
        for quantity in (*quantities, moved):
            error = step_error(quantity, names, now, before, truth_now, truth_before)
            errors.setdefault(str(step), {}).setdefault(quantity, {})[side.label] = error
            if error > FARTHER:
                flags.append({"step": step, "quantity": quantity, "side": side.label, "runner": side.runner,
                              "error": error})


def step_error(quantity: str, names, now, before, truth_now, truth_before) -> float:
    """sum |side's step - truth's step| / sum |truth's step| over every parameter's `quantity` (a gradient: its
    value; the optimizer's state, masters, parameters: their change in the step). A side's masters are its
    parameters on the truth (which keeps none); 0 when both are 0, inf when only the truth's is."""
    source = "param" if quantity == "master" else quantity
    off = size = 0.0
    for name in names:
        got, want = now(f"{quantity}.{name}"), truth_now(f"{source}.{name}")
        if got is None or want is None:
            continue
        if quantity != "grad":
            got_before, want_before = before(f"{quantity}.{name}"), truth_before(f"{source}.{name}")
            if got_before is None or want_before is None:
                continue
            got, want = got - got_before, want - want_before
        off += float(np.sum(np.abs(got - want)))
        size += float(np.sum(np.abs(want)))
    return off / size if size else (0.0 if off == 0 else math.inf)


def initial_state(case: Case, files) -> dict[str, np.ndarray]:
    """The checkpoint's parameters that are canonical ones as they are (same name, same shape), in float64."""
    shapes = dict(train_state_names(case.config["model"]))
    out = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                if name in shapes and list(handle.get_slice(name).get_shape()) == list(shapes[name]):
                    out[name] = handle.get_tensor(name).astype(np.float64)
    return out


def _states(side: SideResult, step: int, initial: dict[str, np.ndarray]):
    """A reader of one side's state after `step` in float64 (`quantity.name` -> array, None where absent), or None
    when the step's tensors were not kept. After step 0: the checkpoint's parameters (and masters) where
    ``initial_state`` has them, zeros for the optimizer's state."""
    if step == 0:
        def before_training(key: str):
            quantity, name = key.split(".", 1)
            if quantity in ("param", "master"):
                return initial.get(name)
            return np.float64(0.0)
        return before_training
    path = step_file(side.folder, step)
    if not path.exists():
        return None
    handle = safe_open(str(path), framework="numpy")
    held = set(handle.keys())
    if not any(".param." in name for name in held):  # only its scalars and digests: the step was not kept
        return None

    def after(key: str):
        name = f"step{step}.{key}"
        return handle.get_tensor(name).astype(np.float64) if name in held else None
    return after


def held_states(side: SideResult, step: int, initial: dict[str, np.ndarray]):
    """``_states`` of `step` read into memory now, so that its file can be given back before the next step is
    judged: every tensor but the gradients and the scalars (what the next step's checks read of the state before
    it: ``_truth_step``'s and ``step_error``'s `before`); asking it for a gradient is a KeyError, never a None."""
    if _states(side, step, initial) is None:
        return None
    with safe_open(str(step_file(side.folder, step)), framework="numpy") as handle:
        held = {name: handle.get_tensor(name) for name in handle.keys()
                if name.count(".") > 1 and ".grad." not in name}

    def after(key: str):
        if key.startswith("grad."):
            raise KeyError(f"{key} of step {step} was not held (only the state a later step reads)")
        value = held.get(f"step{step}.{key}")
        return None if value is None else value.astype(np.float64)
    return after
