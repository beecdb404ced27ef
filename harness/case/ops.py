"""The op records: what each op reads and writes, in canonical names and layout, independent of any framework.

One record per op (like PyTorch's OpInfo): its shape fields, inputs and outputs, the knobs it reads with their
defaults, how tensor parallelism splits it, its stages (multi-op blocks), whether the truth oracle covers it, and
the case family it belongs to. The case loader resolves every knob's default once, so the request a runner reads
is complete; runners never decide a default.

Canonical layout is Megatron's: a linear weight is ``[out, in]``; activations are ``[tokens, hidden]``
(a runner may reshape to its framework's own convention and must reshape back).

Adding an op:
1. a record here (``Op(...)``, added to ``OPS``), with the knobs it reads;
2. one function per runner, in the runner's table keyed by the record (``harness/runners/megatron_ops.py``
   ``IMPLEMENTATIONS``, ``harness/runners/paddle_ops.py`` ``IMPLEMENTATIONS``); a runner without one answers
   UNSUPPORTED. The Paddle side has three levels (``harness/runners/paddle_levels.py``): PaddleFleet's module
   (``paddle_fleet.py``), PaddleFormers' module (``paddle_formers.py``) and the recipe (``paddle_ops.py``); an op
   missing from a level's table makes that level unavailable for it (the doctor says so);
3. cases in ``cases/*.toml``: a reduced CPU case, a negative control (``perturb``) and a ``_full`` GPU twin
   (``tests/test_catalogue.py`` checks every family has them);
4. the oracle: set ``oracle`` to the formula it computes (``harness/runners/oracle.py`` ``FORMULAS``), or leave
   it None (the oracle side then says UNSUPPORTED).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str  # "weight" | "input" | "grad" (an upstream gradient fed to backward) | "ids" | "output"
    dtype: str | None = None  # None: the case's dtype; else fixed (fp32 router probabilities, int64 ids)
    high: int = 0  # for integer tensors: values are drawn from [0, high)


@dataclass(frozen=True)
class Knob:
    """A config setting an op reads; `default` is what the case gets when it does not say."""

    types: tuple[type, ...]
    default: object
    doc: str
    choices: tuple = ()


KNOBS: dict[str, Knob] = {
    "bias": Knob((bool,), False, "linear layers add a bias"),
    "use_accuracy_compatible": Knob((bool, str), True, "PaddleFleet's accuracy gate (newer PaddleFleet also "
                                    "accepts \"megatron\" / \"hf\")"),
    "sequence_parallel": Knob((bool,), False, "Megatron's config.sequence_parallel: tokens split across the TP "
                              "ranks around the parallel linears"),
    "eps": Knob((float,), 1e-6, "RMSNorm epsilon"),
    "per_token_scale": Knob((bool,), False, "SwiGLU multiplied by a per-token fp32 scale (MoE routing "
                            "probabilities)"),
    "deterministic_mode": Knob((bool,), False, "Megatron's embedding: weight[ids] instead of F.embedding"),
    "topk_scaling_factor": Knob((float,), 2.827, "MoE router: probabilities scaled after top-k normalisation"),
    "swiglu_impl": Knob((str,), "fused", "Megatron's SwiGLU: fused (hand-written backward) or eager",
                        ("fused", "eager")),
    "paddle_impl": Knob((str,), "auto", "which Paddle implementation runs: auto (the highest level available "
                        "here), paddlefleet (PaddleFleet's own module), paddleformers (PaddleFormers' module), "
                        "recipe (plain Paddle ops, not PaddleFleet)", ("auto", "paddlefleet", "paddleformers",
                                                                       "recipe")),
}
# Knobs every op reads (the Paddle runner's implementation level), resolved for every case.
COMMON_KNOBS = ("paddle_impl",)


@dataclass(frozen=True)
class Stage:
    """One op inside a multi-op block, with its tensors named by the block's names (for re-feed)."""

    name: str
    op: str
    shapes: dict[str, int]
    config: dict[str, object]
    inputs: dict[str, str]  # the stage op's input name -> the block tensor it reads
    outputs: dict[str, str]  # the stage op's output name -> the block tensor it makes


@dataclass(frozen=True, eq=False)  # eq=False: records are compared and hashed by identity (runner tables key on them)
class Op:
    name: str
    family: str  # the case family; every family needs a CPU case, a negative control and a `_full` GPU twin
    shape_fields: tuple[str, ...]
    inputs: Callable[[Mapping[str, int], int, Mapping[str, object]], list[TensorSpec]]
    outputs: Callable[[Mapping[str, int], int, Mapping[str, object]], list[TensorSpec]]
    tp_split_field: str  # the shape field that tensor parallelism divides
    knobs: tuple[str, ...] = ()  # names in KNOBS this op reads
    # Canonical dim each input and output is split on across tensor-parallel ranks, None where every rank
    # holds the whole tensor (replicated, or already all-reduced); the harness gathers shards with it.
    partition: Callable[[Mapping[str, object]], dict[str, int | None]] = lambda config: {}
    # Multi-op blocks: their ops in forward order, so re-feed can run each one from the other side's tensors.
    stages: Callable[[Mapping[str, int], Mapping[str, object]], list[Stage]] | None = None
    oracle: str | None = None  # the truth oracle's formula for this op (harness.runners.oracle), None: no oracle
    # Outputs that each tensor-parallel rank holds as a partial sum, all-reduced across ranks as Megatron does
    # (a framework path without its own TP layers sums them itself).
    reduced: tuple[str, ...] = ()

    def resolve(self, config: Mapping[str, object]) -> dict[str, object]:
        """The case's knobs completed with this op's defaults (knobs the op does not read are kept as given)."""
        return {**{name: KNOBS[name].default for name in (*self.knobs, *COMMON_KNOBS)}, **config}



def _linear_inputs(shapes, tokens, config):
    n_in, n_out = shapes["input_size"], shapes["output_size"]
    specs = [
        TensorSpec("input", (tokens, n_in), "input"),
        TensorSpec("weight", (n_out, n_in), "weight"),
        TensorSpec("grad_output", (tokens, n_out), "grad"),
    ]
    if config.get("bias", False):
        specs.append(TensorSpec("bias", (n_out,), "weight"))
    return specs


def _linear_outputs(shapes, tokens, config):
    n_in, n_out = shapes["input_size"], shapes["output_size"]
    specs = [
        TensorSpec("out", (tokens, n_out), "output"),
        TensorSpec("grad.input", (tokens, n_in), "output"),
        TensorSpec("grad.weight", (n_out, n_in), "output"),
    ]
    if config.get("bias", False):
        specs.append(TensorSpec("grad.bias", (n_out,), "output"))
    return specs


def _column_partition(config):
    """Each rank holds W[out/tp] rows: out and weight grads split on the out dim; the input grad is all-reduced
    (with sequence parallel: the input is split on tokens and its grad reduce-scattered back to that split)."""
    tokens_split = 0 if config.get("sequence_parallel", False) else None
    return {"input": tokens_split, "weight": 0, "bias": 0, "grad_output": 1,
            "out": 1, "grad.input": tokens_split, "grad.weight": 0, "grad.bias": 0}


def _row_partition(config):
    """Input and weight split on the in dim; out partial sums all-reduced (sequence parallel: reduce-scattered
    to a split on tokens), bias added after the reduce."""
    tokens_split = 0 if config.get("sequence_parallel", False) else None
    return {"input": 1, "weight": 1, "bias": None, "grad_output": tokens_split,
            "out": tokens_split, "grad.input": 1, "grad.weight": 1, "grad.bias": None}


def _rms_norm_inputs(shapes, tokens, config):
    h = shapes["hidden_size"]
    return [TensorSpec("input", (tokens, h), "input"), TensorSpec("weight", (h,), "weight"),
            TensorSpec("grad_output", (tokens, h), "grad")]


def _rms_norm_outputs(shapes, tokens, config):
    h = shapes["hidden_size"]
    return [TensorSpec("out", (tokens, h), "output"), TensorSpec("grad.input", (tokens, h), "output"),
            TensorSpec("grad.weight", (h,), "output")]


def _swiglu_inputs(shapes, tokens, config):
    f = shapes["ffn_hidden_size"]
    specs = [TensorSpec("input", (tokens, 2 * f), "input"), TensorSpec("grad_output", (tokens, f), "grad")]
    if config.get("per_token_scale", False):  # MoE routing probabilities: fp32 in both frameworks
        specs.append(TensorSpec("per_token_scale", (tokens,), "input", "float32"))
    return specs


def _swiglu_outputs(shapes, tokens, config):
    f = shapes["ffn_hidden_size"]
    specs = [TensorSpec("out", (tokens, f), "output"), TensorSpec("grad.input", (tokens, 2 * f), "output")]
    if config.get("per_token_scale", False):
        specs.append(TensorSpec("grad.per_token_scale", (tokens,), "output", "float32"))
    return specs


def _embedding_inputs(shapes, tokens, config):
    v, h = shapes["vocab_size"], shapes["hidden_size"]
    return [TensorSpec("ids", (tokens,), "ids", "int64", high=v), TensorSpec("weight", (v, h), "weight"),
            TensorSpec("grad_output", (tokens, h), "grad")]


def _embedding_outputs(shapes, tokens, config):
    v, h = shapes["vocab_size"], shapes["hidden_size"]
    return [TensorSpec("out", (tokens, h), "output"), TensorSpec("grad.weight", (v, h), "output")]


def _mlp_inputs(shapes, tokens, config):
    h, f = shapes["hidden_size"], shapes["ffn_hidden_size"]
    return [TensorSpec("input", (tokens, h), "input"), TensorSpec("fc1_weight", (2 * f, h), "weight"),
            TensorSpec("fc2_weight", (h, f), "weight"), TensorSpec("grad_output", (tokens, h), "grad")]


def _mlp_outputs(shapes, tokens, config):
    """In topological order (forward, then backward as autograd meets them): the report's first
    divergence is the first tensor of this list that differs."""
    h, f = shapes["hidden_size"], shapes["ffn_hidden_size"]
    return [TensorSpec("intermediate.fc1_out", (tokens, 2 * f), "output"),
            TensorSpec("intermediate.act_out", (tokens, f), "output"),
            TensorSpec("out", (tokens, h), "output"),
            TensorSpec("grad.fc2_weight", (h, f), "output"),
            TensorSpec("intermediate.grad_act_out", (tokens, f), "output"),
            TensorSpec("intermediate.grad_fc1_out", (tokens, 2 * f), "output"),
            TensorSpec("grad.fc1_weight", (2 * f, h), "output"),
            TensorSpec("grad.input", (tokens, h), "output")]


def _mlp_stages(shapes, config):
    h, f = shapes["hidden_size"], shapes["ffn_hidden_size"]
    linear = {k: v for k, v in config.items() if k in ("use_accuracy_compatible", *COMMON_KNOBS)}
    act = {k: v for k, v in config.items() if k in ("use_accuracy_compatible", "swiglu_impl", *COMMON_KNOBS)}
    return [
        Stage("fc1", "column_parallel_linear", {"input_size": h, "output_size": 2 * f}, linear,
              {"input": "input", "weight": "fc1_weight", "grad_output": "intermediate.grad_fc1_out"},
              {"out": "intermediate.fc1_out", "grad.input": "grad.input", "grad.weight": "grad.fc1_weight"}),
        Stage("act", "swiglu", {"ffn_hidden_size": f}, act,
              {"input": "intermediate.fc1_out", "grad_output": "intermediate.grad_act_out"},
              {"out": "intermediate.act_out", "grad.input": "intermediate.grad_fc1_out"}),
        Stage("fc2", "row_parallel_linear", {"input_size": f, "output_size": h}, linear,
              {"input": "intermediate.act_out", "weight": "fc2_weight", "grad_output": "grad_output"},
              {"out": "out", "grad.input": "intermediate.grad_act_out", "grad.weight": "grad.fc2_weight"}),
    ]


def _router_inputs(shapes, tokens, config):
    h, e = shapes["hidden_size"], shapes["num_experts"]
    return [TensorSpec("input", (tokens, h), "input"), TensorSpec("weight", (e, h), "weight"),
            TensorSpec("expert_bias", (e,), "weight", "float32"),
            TensorSpec("grad_probs", (tokens, e), "grad", "float32")]


def _router_outputs(shapes, tokens, config):
    """probs: [tokens, experts], zero off the top-k; topk_indices: each row's chosen experts, ascending."""
    h, e, k = shapes["hidden_size"], shapes["num_experts"], shapes["topk"]
    return [TensorSpec("topk_indices", (tokens, k), "output", "int64"),
            TensorSpec("probs", (tokens, e), "output", "float32"),
            TensorSpec("grad.input", (tokens, h), "output"),
            TensorSpec("grad.weight", (e, h), "output")]


def _attention_inputs(shapes, tokens, config):
    n, d = shapes["num_heads"], shapes["head_dim"]
    return [TensorSpec("query", (tokens, n, d), "input"), TensorSpec("key", (tokens, n, d), "input"),
            TensorSpec("grad_output", (n, tokens, tokens), "grad")]


def _attention_outputs(shapes, tokens, config):
    """Scores (QK^T * softmax scale, before the mask), then the causal-masked probabilities, then grads."""
    n, d = shapes["num_heads"], shapes["head_dim"]
    return [TensorSpec("intermediate.scores", (n, tokens, tokens), "output"),
            TensorSpec("out", (n, tokens, tokens), "output"),
            TensorSpec("grad.query", (tokens, n, d), "output"), TensorSpec("grad.key", (tokens, n, d), "output")]


def uneven_split(tokens: int, experts: int) -> list[int]:
    """Tokens per local expert, deliberately unequal (expert i gets a share proportional to i + 1, the last one
    the remainder), as a router leaves them; both runners split the permuted tokens by this."""
    total = experts * (experts + 1) // 2
    counts = [tokens * (i + 1) // total for i in range(experts - 1)]
    return counts + [tokens - sum(counts)]


def _experts_inputs(shapes, tokens, config):
    h, f, e = shapes["hidden_size"], shapes["ffn_hidden_size"], shapes["num_local_experts"]
    return [TensorSpec("input", (tokens, h), "input"), TensorSpec("probs", (tokens,), "input", "float32"),
            TensorSpec("fc1_weight", (e, 2 * f, h), "weight"), TensorSpec("fc2_weight", (e, h, f), "weight"),
            TensorSpec("grad_output", (tokens, h), "grad")]


def _experts_outputs(shapes, tokens, config):
    h, f, e = shapes["hidden_size"], shapes["ffn_hidden_size"], shapes["num_local_experts"]
    return [TensorSpec("out", (tokens, h), "output"), TensorSpec("grad.fc2_weight", (e, h, f), "output"),
            TensorSpec("grad.probs", (tokens,), "output", "float32"),
            TensorSpec("grad.fc1_weight", (e, 2 * f, h), "output"), TensorSpec("grad.input", (tokens, h), "output")]


def _up_projection_inputs(shapes, tokens, config):
    rank, heads, dim = shapes["lora_rank"], shapes["num_heads"], shapes["head_dim"]
    return [TensorSpec("input", (tokens, rank), "input"), TensorSpec("weight", (heads * dim, rank), "weight"),
            TensorSpec("grad_output", (tokens, heads, dim), "grad")]


def _up_projection_outputs(shapes, tokens, config):
    """out per head, as MLA attention views it: [tokens, heads, head_dim] (head-major rows of the weight)."""
    rank, heads, dim = shapes["lora_rank"], shapes["num_heads"], shapes["head_dim"]
    return [TensorSpec("out", (tokens, heads, dim), "output"), TensorSpec("grad.input", (tokens, rank), "output"),
            TensorSpec("grad.weight", (heads * dim, rank), "output")]


def _up_projection_partition(config):
    """Column-parallel over heads: each rank holds whole heads (weight rows, out's head dim); the input grad is
    all-reduced."""
    return {"input": None, "weight": 0, "grad_output": 1, "out": 1, "grad.input": None, "grad.weight": 0}


LINEAR_KNOBS = ("bias", "use_accuracy_compatible", "sequence_parallel")
COLUMN_PARALLEL_LINEAR = Op("column_parallel_linear", "linear", ("input_size", "output_size"), _linear_inputs,
                            _linear_outputs, "output_size", LINEAR_KNOBS, _column_partition, oracle="linear",
                            reduced=("grad.input",))
ROW_PARALLEL_LINEAR = Op("row_parallel_linear", "linear", ("input_size", "output_size"), _linear_inputs,
                         _linear_outputs, "input_size", LINEAR_KNOBS, _row_partition, oracle="linear",
                         reduced=("out",))
RMS_NORM = Op("rms_norm", "norm", ("hidden_size",), _rms_norm_inputs, _rms_norm_outputs, "hidden_size",
              ("eps", "use_accuracy_compatible"))
SWIGLU = Op("swiglu", "activation", ("ffn_hidden_size",), _swiglu_inputs, _swiglu_outputs, "ffn_hidden_size",
            ("per_token_scale", "swiglu_impl", "use_accuracy_compatible"))
EMBEDDING = Op("embedding", "embedding", ("vocab_size", "hidden_size"), _embedding_inputs, _embedding_outputs,
               "vocab_size", ("deterministic_mode", "use_accuracy_compatible"))
MOE_ROUTER = Op("moe_router", "router", ("hidden_size", "num_experts", "topk"), _router_inputs, _router_outputs,
                "num_experts", ("topk_scaling_factor", "use_accuracy_compatible"))
ATTENTION_SCORES = Op("attention_scores", "attention", ("num_heads", "head_dim"), _attention_inputs,
                      _attention_outputs, "num_heads", ("use_accuracy_compatible",))
ROUTED_EXPERTS = Op("routed_experts", "experts", ("hidden_size", "ffn_hidden_size", "num_local_experts"),
                    _experts_inputs, _experts_outputs, "ffn_hidden_size", ("use_accuracy_compatible",))
SHARED_EXPERT_MLP = Op("shared_expert_mlp", "mlp_block", ("hidden_size", "ffn_hidden_size"), _mlp_inputs,
                       _mlp_outputs, "ffn_hidden_size", ("swiglu_impl", "use_accuracy_compatible"),
                       stages=_mlp_stages)
# MLA's q/kv up-projections (q_b: q_lora -> heads x (nope + rope); kv_b: kv_lora -> heads x (nope + v)).
MLA_UP_PROJECTION = Op("mla_up_projection", "mla_up_projection", ("lora_rank", "num_heads", "head_dim"),
                       _up_projection_inputs, _up_projection_outputs, "num_heads", ("use_accuracy_compatible",),
                       _up_projection_partition, oracle="linear", reduced=("grad.input",))

OPS: dict[str, Op] = {op.name: op for op in (
    COLUMN_PARALLEL_LINEAR, ROW_PARALLEL_LINEAR, RMS_NORM, SWIGLU, EMBEDDING, MOE_ROUTER, ATTENTION_SCORES,
    ROUTED_EXPERTS, SHARED_EXPERT_MLP, MLA_UP_PROJECTION,
)}
