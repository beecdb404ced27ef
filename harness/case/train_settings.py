"""The ``train`` table of a training case (op ``causal_lm_train``) as typed settings: ``TrainSettings`` and, for a
negative control, its planted ``Flip``. ``parse`` defaults and validates every field (each error names file, case,
field and value); code reads ``case.train.steps``.

At the boundary the settings are a dict: ``to_dict`` writes the request's ``config.train`` (and report.json's case),
which every runner reads back with ``from_dict``, so every side trains with the same settings and none decides a
default. For an AdamW case the dict is the one cases had before the optimizer records; ``optimizer`` appears in it only
when it is not AdamW, followed by that optimizer's own fields (``harness.optimizers``: each optimizer's record says its
fields, its state and how each stack builds it).

A field is one of the case's training settings; how each stack expresses it in its own API is the runners' business
(``harness/runners/*/train.py``, the optimizer's record), and docs/training.md says it per stack. Where the stacks
differ by a choice (which parameters weight decay applies to, torch AdamW's implementation), the default is each
stack's own choice ("default") and the case may set one for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from harness.families import routed_experts
from harness.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from harness.optimizers import OPTIMIZERS, Optimizer, optimizer

DECAY_STYLES = ("cosine", "constant")
WEIGHT_DECAY_PARAMS = {
    "default": "each stack's own choice: Megatron exempts 1-D parameters (norms) and biases, torch and Paddle decay "
               "every parameter",
    "all": "every parameter decays (Megatron: config_overrides={}; torch: one param group; Paddle: no "
           "apply_decay_param_fun)",
    "not_1d": "1-D parameters do not decay (Megatron's default; torch: a param group with weight_decay 0; Paddle: "
              "apply_decay_param_fun, or with Momentum an L2Decay(0.0) regularizer per parameter)",
}
EXPERT_BIAS_UPDATE = {
    "default": "each stack's own: Megatron adds sign(mean load - load) x moe_router_bias_update_rate (1e-3) to each "
               "routing bias after every step (finalize_model_grads); HF's and Paddle's training code leave it",
    "off": "no stack updates it (Megatron: moe_router_bias_update_rate = 0)",
}
FLIP_FIELDS = {"side", "after_step", "state", "tensor", "index", "bit", "rank"}
RANK_SIZES = (1, 2, 4, 8)  # data- and expert-parallel sizes (docs/training-ranks.md)
# The runners with an expert-parallel MoE layer: Megatron-Core's (its token dispatcher), PaddleFormers' (DeepEP only:
# UNSUPPORTED without it). HF transformers' DeepseekV3 has no expert-parallel plan (transformers 5.3).
EXPERT_PARALLEL_RUNNERS = ("megatron_model", "paddle_model")

# field -> (accepted types, default), every optimizer's; a default of None is resolved from other fields (below). In
# the dict's order the optimizer's own fields follow min_lr and its stack fields follow ep (the order AdamW's had).
HEAD = {
    "steps": ((int,), 3),
    "micro_batches": ((int,), 1),
    "lr": ((float,), 1e-3),
    "min_lr": ((float,), 0.0),
}
MIDDLE = {
    "weight_decay": ((float,), 0.1),
    "weight_decay_params": ((str,), "default"),
    "clip_grad": ((float,), 1.0),
    "warmup_steps": ((int,), 0),  # the warmup starts at lr 0 (Megatron's lr_warmup_init default, HF's, Paddle's)
    "decay_style": ((str,), "cosine"),
    "decay_steps": ((int,), None),  # default: steps
    "master_weights": ((bool,), None),  # default: True for bfloat16, else False
    "distributed_optimizer": ((bool,), False),
    "dp": ((int,), 1),  # data-parallel ranks, each training its own micro-batches of the same global batch
    "ep": ((int,), 1),  # expert-parallel ranks among them (Megatron's MoE layer; ep divides dp)
}
TAIL = {
    "expert_bias_update": ((str,), "default"),
    "steps_kept": ((str, list), "all"),
    "flip": ((dict,), None),
}
FIELDS = {**HEAD, **MIDDLE, **TAIL}  # the fields every optimizer shares


@dataclass(frozen=True)
class Flip:
    """The negative control's planted flip: one bit of one element of one state tensor, on one side, right after a
    step (its outputs written first), so the next step starts from it. On every data-parallel rank (each its own copy
    or piece: the ranks stay consistent), or with `rank` on that one only (a planted departure of one rank)."""

    side: str  # "a" or "b"
    after_step: int
    state: str  # a state quantity: the optimizer's, "master" or "param"
    tensor: str  # canonical parameter name
    index: tuple[int, ...]
    bit: int
    rank: int | None = None

    def to_dict(self) -> dict:
        return {"side": self.side, "after_step": self.after_step, "state": self.state, "tensor": self.tensor,
                "index": list(self.index), "bit": self.bit, "rank": self.rank}

    @classmethod
    def from_dict(cls, values: dict) -> Flip:
        return cls(values["side"], values["after_step"], values["state"], values["tensor"], tuple(values["index"]),
                   values["bit"], values.get("rank"))


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    micro_batches: int  # gradient accumulation
    lr: float
    min_lr: float
    optimizer: Any  # the optimizer's own settings (harness.optimizers); `.record` is its record
    weight_decay: float
    weight_decay_params: str  # WEIGHT_DECAY_PARAMS
    clip_grad: float  # global norm; 0: no clipping
    warmup_steps: int
    decay_style: str  # DECAY_STYLES
    decay_steps: int
    master_weights: bool  # fp32 masters: exactly the bf16 cases
    distributed_optimizer: bool  # Megatron's
    dp: int
    ep: int
    expert_bias_update: str  # EXPERT_BIAS_UPDATE
    steps_kept: tuple[int, ...]  # the steps whose tensors stay on disk (the others: scalars and digests)
    flip: Flip | None = None
    bare: bool = False  # bench_speed: each stack's training calls alone, nothing observed or written (no case sets it)

    @property
    def record(self) -> Optimizer:
        """The optimizer's record: its state quantities, its builders per stack."""
        return self.optimizer.record

    def to_dict(self) -> dict:
        """The request's ``config.train`` (see the module docstring for its order and its ``optimizer`` field)."""
        record = self.record
        named = {"optimizer": record.name} if record.name != DEFAULT_OPTIMIZER else {}
        own = self.optimizer.to_dict()
        values = {key: getattr(self, key) for key in FIELDS}
        values["steps_kept"] = list(self.steps_kept)
        values["flip"] = self.flip.to_dict() if self.flip else None
        return {**{key: values[key] for key in HEAD}, **named, **{key: own[key] for key in record.fields},
                **{key: values[key] for key in MIDDLE}, **{key: own[key] for key in record.stack_fields},
                **{key: values[key] for key in TAIL}, **({"bare": True} if self.bare else {})}

    @classmethod
    def from_dict(cls, values: dict) -> TrainSettings:
        """The settings a request carries (written by ``to_dict``); a key it does not know or lacks is an error, not
        a default: a request of another version of the harness would otherwise train with other settings."""
        record = optimizer(values.get("optimizer", DEFAULT_OPTIMIZER))
        own = {*record.fields, *record.stack_fields}
        known = {*FIELDS, *own, "optimizer", "bare"}
        unknown = sorted(set(values) - known)
        missing = [key for key in (*FIELDS, *own) if key not in values]
        if unknown or missing:
            raise ValueError(f"config.train of {record.name}: " + "; ".join(
                ([f"unknown {', '.join(unknown)}"] if unknown else []) + ([f"lacks {', '.join(missing)}"]
                                                                          if missing else [])))
        flip = values["flip"]
        return cls(**{key: values[key] for key in FIELDS if key not in ("steps_kept", "flip")},
                   optimizer=record.settings.from_dict({key: values[key] for key in own}),
                   steps_kept=tuple(values["steps_kept"]), flip=Flip.from_dict(flip) if flip else None,
                   bare=bool(values.get("bare", False)))

    def state_choices(self) -> tuple[str, ...]:
        """What a flip may plant a bit in: the optimizer's state, the masters (bf16), the parameters."""
        return (*self.record.state, *(("master",) if self.master_weights else ()), "param")


def parse(f, dtype: str, model: dict, parameters: dict) -> TrainSettings:
    """The case's `train` table, complete. `f` is the registry's field reader (errors name file, case, field, value);
    `parameters` the canonical parameter names and shapes (what a flip may name)."""
    table = f.get("train", dict, {})
    name = f.get("optimizer", str, DEFAULT_OPTIMIZER, where=table, label="train.optimizer")
    if name not in OPTIMIZERS:
        raise f.error("train.optimizer", f"must be one of {', '.join(OPTIMIZERS)}", name)
    record = OPTIMIZERS[name]
    own = {**record.fields, **record.stack_fields}
    fields = {**FIELDS, **own}
    for key in table:
        if key in fields or key == "optimizer":
            continue
        other = next((o for o in OPTIMIZERS.values() if key in o.fields or key in o.stack_fields), None)
        if other is not None:
            raise f.error(f"train.{key}", f"is a setting of {other.label} (optimizer = {other.name!r}); this case "
                                          f"trains with {record.label} (optimizer = {record.name!r})", table[key])
        raise f.error(f"train.{key}", f"unknown field; known: {', '.join(['optimizer', *fields])}", table[key])
    given = {}
    for key, (kinds, _) in fields.items():
        if key in table:
            value = table[key]
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            given[key] = f.get(key, kinds, where={key: value}, label=f"train.{key}")
    raw = {key: given.get(key, default) for key, (_, default) in FIELDS.items()}
    raw["decay_steps"] = raw["steps"] if raw["decay_steps"] is None else raw["decay_steps"]
    if raw["master_weights"] is None:
        raw["master_weights"] = dtype == "bfloat16"

    def bad(key, problem, value=...):
        raise f.error(f"train.{key}", problem, raw[key] if value is ... else value)

    for key in ("steps", "micro_batches", "decay_steps"):
        if raw[key] < 1:
            bad(key, "must be >= 1")
    if raw["warmup_steps"] < 0:
        bad("warmup_steps", "must be >= 0")
    if raw["warmup_steps"] >= raw["decay_steps"]:
        bad("warmup_steps", f"must be < decay_steps ({raw['decay_steps']}): the decay needs a step")
    if not raw["lr"] > 0:
        bad("lr", "must be > 0")
    settings = record.parse({key: value for key, value in given.items() if key in own})
    problem = settings.problem()
    if problem:
        bad(problem[0], problem[1], given.get(problem[0], own[problem[0]][1]))
    if not 0 <= raw["min_lr"] <= raw["lr"]:
        bad("min_lr", f"must be in [0, lr = {raw['lr']}]")
    for key in ("weight_decay", "clip_grad"):
        if raw[key] < 0:
            bad(key, "must be >= 0 (clip_grad 0: no clipping)")
    for key, choices in (("decay_style", DECAY_STYLES), ("weight_decay_params", tuple(WEIGHT_DECAY_PARAMS)),
                         ("expert_bias_update", tuple(EXPERT_BIAS_UPDATE))):
        if raw[key] not in choices:
            bad(key, f"must be one of {', '.join(choices)}")
    if raw["master_weights"] != (dtype == "bfloat16"):
        bad("master_weights", "fp32 master weights are what a bfloat16 case trains with (Megatron keeps them "
                              "always) and what no float32/float64 case has: true exactly for bfloat16")
    if raw["distributed_optimizer"] and not record.distributed_optimizer:
        bad("distributed_optimizer", f"Megatron's DistributedOptimizer takes Adam only (distrib_optimizer.py asserts "
                                     f"it); this case trains with {record.label}")
    kept = steps_kept(raw["steps_kept"], raw["steps"],
                      lambda problem: f.error("train.steps_kept", problem, table.get("steps_kept")))
    flip = raw["flip"]
    settings = TrainSettings(**{key: raw[key] for key in FIELDS if key not in ("steps_kept", "flip")},
                             optimizer=settings, steps_kept=tuple(kept))
    problem = ranks_problem(settings, model)
    if problem:
        bad(*problem)
    if flip is not None:
        settings = replace(settings, flip=_flip(f, settings, flip, dtype, parameters))
    return settings


def ranks_problem(train: TrainSettings, model: dict) -> tuple[str, str] | None:
    """(field, why) when `dp` data-parallel and `ep` expert-parallel ranks cannot split this training run: the one
    check, in one wording, for case files, ``--dp``, ``--ep`` and ``--versus-dp`` / ``--versus-ep``."""
    dp, ep = train.dp, train.ep
    for key, size in (("dp", dp), ("ep", ep)):
        if size not in RANK_SIZES:
            return key, f"must be one of {', '.join(map(str, RANK_SIZES))}"
    if train.micro_batches % dp:
        return "dp", (f"must divide micro_batches ({train.micro_batches}): each rank trains micro_batches / dp "
                      "of the same global batch")
    if dp % ep:
        return "ep", f"must divide dp ({dp}): Megatron splits the experts across the data-parallel ranks"
    if routed_experts(model) % ep:
        return "ep", f"must divide the model's routed experts ({routed_experts(model)})"
    return None


def with_ranks(train: TrainSettings, model: dict, dp: int, ep: int, error) -> TrainSettings:
    """`train` at `dp` x `ep` ranks (the command line's --dp / --ep / --versus-*); `error(field, problem, value)`
    builds the exception to raise."""
    ranked = replace(train, dp=dp, ep=ep)
    problem = ranks_problem(ranked, model)
    if problem:
        raise error(*problem, getattr(ranked, problem[0]))
    return ranked


def rank_micro_batches(micro_batches: int, dp: int, rank: int) -> list[int]:
    """The global micro-batches data-parallel `rank` trains, in its order: every dp-th from `rank` on, as Megatron-LM's
    MegatronPretrainingSampler and torch's DistributedSampler hand out a global batch (micro-batch i of the global
    step goes to rank i mod dp)."""
    return list(range(rank, micro_batches, dp))


def steps_kept(value, steps: int, error) -> list[int]:
    """"all", "last", "none", or a list of step numbers -> the sorted steps whose tensors stay on disk (the others keep
    their scalars and a digest per tensor). `error(problem)` builds the exception to raise."""
    if value == "all":
        return list(range(1, steps + 1))
    if value == "last":
        return [steps]
    if value == "none":  # a full-size model's state (tens of GB per step) as digests only
        return []
    if isinstance(value, str) or not value or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise error('must be "all", "last", "none" or a non-empty list of step numbers')
    outside = [s for s in value if not 1 <= s <= steps]
    if outside:
        raise error(f"step {outside[0]} is outside 1..{steps}")
    return sorted(set(value))


def parse_steps_kept(text: str, steps: int) -> list[int]:
    """``--steps-kept all|last|none|1,3,100`` (the command line's form of the field)."""
    if text in ("all", "last", "none"):
        return steps_kept(text, steps, ValueError)
    try:
        value = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--steps-kept: expected all, last, none or step numbers like 1,3,100 (got {text!r})") \
            from None
    return steps_kept(value, steps, lambda problem: ValueError(f"--steps-kept {text}: {problem}"))


def _flip(f, train: TrainSettings, table: dict, dtype: str, parameters: dict) -> Flip:
    """The case's ``flip`` table (see ``Flip``), checked against the settings: a state the optimizer writes, a
    parameter, an element and a bit of it, a step a later one reads, a rank of the case."""
    for key in sorted(set(table) - FLIP_FIELDS):
        raise f.error(f"train.flip.{key}", f"unknown field; known: {', '.join(sorted(FLIP_FIELDS))}", table[key])

    def field(key, kinds):
        return f.get(key, kinds, where=table, label=f"train.flip.{key}")

    side, after, state, tensor = field("side", str), field("after_step", int), field("state", str), \
        field("tensor", str)
    index, bit = list(field("index", list)), field("bit", int)
    if side not in ("a", "b"):
        raise f.error("train.flip.side", "must be 'a' or 'b'", side)
    if not 1 <= after < train.steps:
        raise f.error("train.flip.after_step", f"must be in 1..{train.steps - 1} (a later step must read it)", after)
    states = train.state_choices()
    if state not in states:
        raise f.error("train.flip.state", f"must be one of {', '.join(states)}", state)
    if tensor not in parameters:
        raise f.error("train.flip.tensor", "no such parameter (canonical names, gate and up fused as "
                                           "'...gate_up_proj.weight')", tensor)
    shape = parameters[tensor]
    if len(index) != len(shape) or not all(isinstance(i, int) and 0 <= i < n for i, n in zip(index, shape,
                                                                                             strict=False)):
        raise f.error("train.flip.index", f"must index into {tensor} of shape {list(shape)}", index)
    width = 64 if dtype == "float64" else 16 if state == "param" and dtype == "bfloat16" else 32
    if not 0 <= bit < width - 1:
        raise f.error("train.flip.bit", f"must be a mantissa or exponent bit of the {width}-bit {state}, "
                                        f"0..{width - 2}", bit)
    rank = f.get("rank", int, None, where=table, label="train.flip.rank")
    if rank is not None and not 0 <= rank < train.dp:
        raise f.error("train.flip.rank", f"must be a data-parallel rank of the case, 0..{train.dp - 1} (train.dp "
                                         f"= {train.dp})", rank)
    return Flip(side, after, state, tensor, tuple(index), bit, rank)
