"""The ``train`` table of a training case (op ``causal_lm_train``): every field defaulted and validated, the result
stored complete in ``config["train"]`` so every runner reads the same settings and decides no default itself.

A field is one of the case's training settings; how each stack expresses it in its own API is the runners' business
(``harness/runners/*/train.py``), and docs/training.md says it per stack. Where the stacks differ by a choice
(which parameters weight decay applies to, torch AdamW's implementation), the default is each stack's own choice
("default") and the case may set one for all of them.
"""

from __future__ import annotations

from typing import Any

from harness.case.ops import STATE_QUANTITIES, train_state_names
from harness.families import routed_experts

DECAY_STYLES = ("cosine", "constant")
WEIGHT_DECAY_PARAMS = {
    "default": "each stack's own choice: Megatron exempts 1-D parameters (norms) and biases, torch and Paddle decay "
               "every parameter",
    "all": "every parameter decays (Megatron: config_overrides={}; torch: one param group; Paddle: no "
           "apply_decay_param_fun)",
    "not_1d": "1-D parameters do not decay (Megatron's default; torch: a param group with weight_decay 0; Paddle: "
              "apply_decay_param_fun)",
}
TORCH_ADAMW = ("default", "for_loop", "foreach", "fused")  # torch.optim.AdamW's foreach / fused flags (hf_model)
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

# field -> (accepted types, default); a default of None is resolved from other fields (below)
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "steps": ((int,), 3),
    "micro_batches": ((int,), 1),
    "lr": ((float,), 1e-3),
    "min_lr": ((float,), 0.0),
    "betas": ((list,), [0.9, 0.95]),
    "eps": ((float,), 1e-8),
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
    "torch_adamw": ((str,), "default"),
    "expert_bias_update": ((str,), "default"),
    "steps_kept": ((str, list), "all"),
    "flip": ((dict,), None),
}


def parse(f, dtype: str, model: dict) -> dict:
    """The case's `train` table, complete. `f` is the registry's field reader (errors name file, case, field, value)."""
    table = f.get("train", dict, {})
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise f.error(f"train.{unknown[0]}", f"unknown field; known: {', '.join(FIELDS)}", table[unknown[0]])
    given = {}
    for key, (kinds, _) in FIELDS.items():
        if key in table:
            value = table[key]
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            given[key] = f.get(key, kinds, where={key: value}, label=f"train.{key}")
    train = {key: given.get(key, default) for key, (_, default) in FIELDS.items()}
    train["decay_steps"] = train["steps"] if train["decay_steps"] is None else train["decay_steps"]
    if train["master_weights"] is None:
        train["master_weights"] = dtype == "bfloat16"

    def bad(key, problem):
        raise f.error(f"train.{key}", problem, train[key])

    for key in ("steps", "micro_batches", "decay_steps"):
        if train[key] < 1:
            bad(key, "must be >= 1")
    if train["warmup_steps"] < 0:
        bad("warmup_steps", "must be >= 0")
    if train["warmup_steps"] >= train["decay_steps"]:
        bad("warmup_steps", f"must be < decay_steps ({train['decay_steps']}): the decay needs a step")
    for key in ("lr", "eps"):
        if not train[key] > 0:
            bad(key, "must be > 0")
    if not 0 <= train["min_lr"] <= train["lr"]:
        bad("min_lr", f"must be in [0, lr = {train['lr']}]")
    for key in ("weight_decay", "clip_grad"):
        if train[key] < 0:
            bad(key, "must be >= 0 (clip_grad 0: no clipping)")
    betas = train["betas"]
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                  for b in betas):
        bad("betas", "must be two numbers in [0, 1): [beta1, beta2]")
    train["betas"] = [float(b) for b in betas]
    for key, choices in (("decay_style", DECAY_STYLES), ("weight_decay_params", tuple(WEIGHT_DECAY_PARAMS)),
                         ("torch_adamw", TORCH_ADAMW), ("expert_bias_update", tuple(EXPERT_BIAS_UPDATE))):
        if train[key] not in choices:
            bad(key, f"must be one of {', '.join(choices)}")
    if train["master_weights"] != (dtype == "bfloat16"):
        bad("master_weights", "fp32 master weights are what a bfloat16 case trains with (Megatron keeps them "
                              "always) and what no float32/float64 case has: true exactly for bfloat16")
    problem = ranks_problem(train, model)
    if problem:
        bad(*problem)
    train["steps_kept"] = steps_kept(train["steps_kept"], train["steps"],
                                     lambda problem: f.error("train.steps_kept", problem, table.get("steps_kept")))
    if train["flip"] is not None:
        train["flip"] = _flip(f, train, dtype, model)
    return train


def ranks_problem(train: dict, model: dict) -> tuple[str, str] | None:
    """(field, why) when `dp` data-parallel and `ep` expert-parallel ranks cannot split this training run: the one
    check, in one wording, for case files, ``--dp``, ``--ep`` and ``--versus-dp`` / ``--versus-ep``."""
    dp, ep = train["dp"], train["ep"]
    for key, size in (("dp", dp), ("ep", ep)):
        if size not in RANK_SIZES:
            return key, f"must be one of {', '.join(map(str, RANK_SIZES))}"
    if train["micro_batches"] % dp:
        return "dp", (f"must divide micro_batches ({train['micro_batches']}): each rank trains micro_batches / dp "
                      "of the same global batch")
    if dp % ep:
        return "ep", f"must divide dp ({dp}): Megatron splits the experts across the data-parallel ranks"
    if routed_experts(model) % ep:
        return "ep", f"must divide the model's routed experts ({routed_experts(model)})"
    return None


def with_ranks(train: dict, model: dict, dp: int, ep: int, error) -> dict:
    """`train` at `dp` x `ep` ranks (the command line's --dp / --ep / --versus-*); `error(field, problem, value)`
    builds the exception to raise."""
    ranked = {**train, "dp": dp, "ep": ep}
    problem = ranks_problem(ranked, model)
    if problem:
        raise error(*problem, ranked[problem[0]])
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


def _flip(f, train: dict, dtype: str, model: dict) -> dict:
    """The negative control's planted flip: one bit of one element of one optimizer state tensor, on one side, right
    after a step (its outputs written first), so the next step starts from it. On every data-parallel rank (each its
    own copy or piece: the ranks stay consistent), or with `rank` on that one only (a planted departure of one rank
    from the others)."""
    table = train["flip"]
    for key in sorted(set(table) - FLIP_FIELDS):
        raise f.error(f"train.flip.{key}", f"unknown field; known: {', '.join(sorted(FLIP_FIELDS))}", table[key])

    def field(key, kinds):
        return f.get(key, kinds, where=table, label=f"train.flip.{key}")

    side, after, state, tensor = field("side", str), field("after_step", int), field("state", str), \
        field("tensor", str)
    index, bit = list(field("index", list)), field("bit", int)
    if side not in ("a", "b"):
        raise f.error("train.flip.side", "must be 'a' or 'b'", side)
    if not 1 <= after < train["steps"]:
        raise f.error("train.flip.after_step", f"must be in 1..{train['steps'] - 1} (a later step must read it)",
                      after)
    states = [q for q in STATE_QUANTITIES if q != "grad" and (q != "master" or train["master_weights"])]
    if state not in states:
        raise f.error("train.flip.state", f"must be one of {', '.join(states)}", state)
    shapes = dict(train_state_names(model))
    if tensor not in shapes:
        raise f.error("train.flip.tensor", "no such parameter (canonical names, gate and up fused as "
                                           "'...gate_up_proj.weight')", tensor)
    shape = shapes[tensor]
    if len(index) != len(shape) or not all(isinstance(i, int) and 0 <= i < n for i, n in zip(index, shape,
                                                                                             strict=False)):
        raise f.error("train.flip.index", f"must index into {tensor} of shape {list(shape)}", index)
    width = 64 if dtype == "float64" else 16 if state == "param" and dtype == "bfloat16" else 32
    if not 0 <= bit < width - 1:
        raise f.error("train.flip.bit", f"must be a mantissa or exponent bit of the {width}-bit {state}, "
                                        f"0..{width - 2}", bit)
    rank = f.get("rank", int, None, where=table, label="train.flip.rank")
    if rank is not None and not 0 <= rank < train["dp"]:
        raise f.error("train.flip.rank", f"must be a data-parallel rank of the case, 0..{train['dp'] - 1} (train.dp "
                                         f"= {train['dp']})", rank)
    return {"side": side, "after_step": after, "state": state, "tensor": tensor, "index": index, "bit": bit,
            "rank": rank}
