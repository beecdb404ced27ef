"""The op records: what each op reads and writes, in canonical names and layout, independent of any framework.

One record per op (like PyTorch's OpInfo): its shape fields, inputs and outputs, the knobs it reads with their
defaults, how tensor parallelism splits it, its stages (multi-op blocks), whether the truth oracle covers it, and
the case family it belongs to. The case loader resolves every knob's default once, so the request a runner reads
is complete; runners never decide a default.

Canonical layout is Megatron's: a linear weight is ``[out, in]``; activations are ``[tokens, hidden]``
(a runner may reshape to its framework's own convention and must reshape back).

Adding an op:
1. a record here (``Op(...)``, added to ``OPS``), with the knobs it reads (and ``batch_mixed`` saying why, where a
   row's outputs depend on the other rows by definition: ``--versus batch`` refuses it);
2. one function per runner, in the runner's table keyed by the record (``harness/runners/megatron/ops.py``
   ``IMPLEMENTATIONS``, ``harness/runners/paddle/recipe.py`` ``IMPLEMENTATIONS``); a runner without one answers
   UNSUPPORTED. The Paddle side has three levels (``harness/runners/paddle/levels.py``): PaddleFleet (``fleet.py``),
   PaddleFormers' module (``formers.py``) and the recipe (``recipe.py``, its ``SOURCES`` naming what it follows); an op
   missing from a level's table makes that level unavailable for it (the doctor says so);
3. cases in ``cases/*.toml``: a reduced CPU case, a negative control (``perturb``) and a ``_full`` GPU twin
   (``tests/test_catalogue.py`` checks every family has them);
4. the oracle: set ``oracle`` to the formula it computes (``harness/runners/oracle/runner.py`` ``FORMULAS``), or leave
   it None (the oracle side then says UNSUPPORTED).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from harness.case.specs import FLOAT32_OR_WIDER, TensorSpec
from harness.case.train_settings import TrainSettings
from harness.families import model_config
from harness.optimizers import Optimizer

# MLA's softmax scale with YaRN (MLASelfAttention: mscale = 0.1 * mscale_all_dim * ln(factor) + 1, scale = mscale^2 /
# sqrt(qk_nope + qk_rope)), at Kimi-K2's factor 32, mscale_all_dim 1, head dim 192.
KIMI_SOFTMAX_SCALE = (0.1 * 1.0 * math.log(32.0) + 1.0) ** 2 / math.sqrt(192)


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
                        "here), paddlefleet (PaddleFleet's modules), paddleformers (PaddleFormers' module), "
                        "recipe (plain Paddle ops computing what PaddleFleet's code computes, not PaddleFleet), "
                        "fp32_islands (the recipe with the seed PR's FP32-island SwiGLU)",
                        ("auto", "paddlefleet", "paddleformers", "recipe", "fp32_islands")),
    "model": Knob((dict,), {}, "model cases: the model's config in its family's HF config key names, `family` "
                  "naming the family (harness/families/); every default resolved when the case loads"),
    # YaRN rotary embedding (Kimi-K2's YaRN)
    "rotary_base": Knob((float,), 50000.0, "RoPE theta (Kimi-K2: 50000)"),
    "rotary_scaling_factor": Knob((float,), 32.0, "YaRN factor (Kimi-K2: 32)"),
    "original_max_position_embeddings": Knob((int,), 4096, "YaRN original context length (Kimi-K2: 4096)"),
    "beta_fast": Knob((float,), 1.0, "YaRN beta_fast (Kimi-K2: 1)"),
    "beta_slow": Knob((float,), 1.0, "YaRN beta_slow (Kimi-K2: 1)"),
    "mscale": Knob((float,), 1.0, "YaRN mscale (Kimi-K2: 1)"),
    "mscale_all_dim": Knob((float,), 1.0, "YaRN mscale_all_dim (Kimi-K2: 1)"),
    "softmax_scale": Knob((float,), KIMI_SOFTMAX_SCALE, "core attention's QK^T scale (Kimi-K2's MLA: "
                          "yarn_mscale(32, 1)^2 / sqrt(192))"),
}
# Knobs every op reads (the Paddle runner's implementation level), resolved for every case.
COMMON_KNOBS = ("paddle_impl",)
# Set by re-feed only, never by a case: "<block op>.<stage>" (e.g. "shared_expert_mlp.fc1"), so that a runner whose
# implementation of the block splits a stage differently (PaddleFormers' gate_proj + up_proj for fc1) runs the stage
# as the block ran it.
REFEED_STAGE = "refeed_stage"


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
    tp_split_field: str | None  # the shape field that tensor parallelism divides (None: TP=1 only)
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
    level: str = "op"  # the level that runs and compares it (harness.levels): op, model or train
    tables: tuple[str, ...] = ()  # case tables it reads beyond the common fields ("train": harness.case.train_settings)
    # Why a row's outputs depend on the other rows by definition ("" where each row's outputs depend on that row and
    # the weights alone): ``--versus batch`` (harness.case.batch) refuses such an op, saying why.
    batch_mixed: str = ""

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


def _rope_inputs(shapes, tokens, config):
    """MLA's rope parts: q_pe per head, k_pe shared by every head (it comes from kv_down_proj), and the upstream
    grads of q_pe and of k_pe after its expand to every head."""
    n, d = shapes["num_heads"], shapes["rope_dim"]
    return [TensorSpec("query", (tokens, n, d), "input"), TensorSpec("key", (tokens, d), "input"),
            TensorSpec("grad_query", (tokens, n, d), "grad"), TensorSpec("grad_key", (tokens, n, d), "grad")]


def _rope_outputs(shapes, tokens, config):
    """The YaRN table (fp32 angles position x inv_freq), its cos and sin times mscale cast to the input dtype (the
    modules' own get_cached_cos_sin: what the rotation multiplies by), the rotated q_pe and k_pe (k_pe before its
    expand to heads), then their grads (k_pe's summed over the heads by the expand's backward)."""
    n, d = shapes["num_heads"], shapes["rope_dim"]
    return [TensorSpec("intermediate.freqs", (tokens, d), "output", "float32"),
            TensorSpec("intermediate.cos", (tokens, d), "output"),
            TensorSpec("intermediate.sin", (tokens, d), "output"),
            TensorSpec("out.query", (tokens, n, d), "output"), TensorSpec("out.key", (tokens, d), "output"),
            TensorSpec("grad.query", (tokens, n, d), "output"), TensorSpec("grad.key", (tokens, d), "output")]


def _core_attention_inputs(shapes, tokens, config):
    n, d, dv = shapes["num_heads"], shapes["head_dim"], shapes["v_head_dim"]
    return [TensorSpec("query", (tokens, n, d), "input"), TensorSpec("key", (tokens, n, d), "input"),
            TensorSpec("value", (tokens, n, dv), "input"), TensorSpec("grad_output", (tokens, n, dv), "grad")]


def _core_attention_outputs(shapes, tokens, config):
    """Causal probabilities (softmax output), context, then backward in autograd's order: the probabilities' grad
    and the value grad (from the context bmm), then query and key grads (through the softmax and QK^T)."""
    n, d, dv = shapes["num_heads"], shapes["head_dim"], shapes["v_head_dim"]
    return [TensorSpec("intermediate.probs", (n, tokens, tokens), "output"),
            TensorSpec("out", (tokens, n, dv), "output"),
            TensorSpec("intermediate.grad_probs", (n, tokens, tokens), "output"),
            TensorSpec("grad.value", (tokens, n, dv), "output"),
            TensorSpec("grad.query", (tokens, n, d), "output"), TensorSpec("grad.key", (tokens, n, d), "output")]


def _core_attention_partition(config):
    """Heads split across ranks; no communication inside core attention."""
    return {"query": 1, "key": 1, "value": 1, "grad_output": 1, "intermediate.probs": 0, "out": 1,
            "intermediate.grad_probs": 0, "grad.value": 1, "grad.query": 1, "grad.key": 1}


def combine_routing(tokens: int, experts: int, topk: int) -> list[list[int]]:
    """Each token's top-k experts (distinct, unsorted as a router leaves them), spread so experts get unequal
    token counts; both runners build the routing map and the expert-major permutation from this."""
    return [[(token * 5 + 3 * j + (token * j) % 2) % experts for j in range(topk)] if topk * 3 < experts
            else [(token + j) % experts for j in range(topk)] for token in range(tokens)]


def _combine_inputs(shapes, tokens, config):
    """The routed experts' outputs in expert-major (permuted) order, already weighted by the routing probability
    (both gated paths apply it inside the experts' SwiGLU), and the shared expert's output."""
    h, k = shapes["hidden_size"], shapes["topk"]
    return [TensorSpec("expert_output", (tokens * k, h), "input"), TensorSpec("shared_output", (tokens, h), "input"),
            TensorSpec("grad_output", (tokens, h), "grad")]


def _combine_outputs(shapes, tokens, config):
    h, k = shapes["hidden_size"], shapes["topk"]
    return [TensorSpec("out", (tokens, h), "output"), TensorSpec("grad.expert_output", (tokens * k, h), "output"),
            TensorSpec("grad.shared_output", (tokens, h), "output")]


def _lm_head_inputs(shapes, tokens, config):
    h, v = shapes["hidden_size"], shapes["vocab_size"]
    return [TensorSpec("input", (tokens, h), "input"), TensorSpec("weight", (v, h), "weight"),
            TensorSpec("labels", (tokens,), "ids", "int64", high=v)]


def _lm_head_outputs(shapes, tokens, config):
    """Logits, per-token cross entropy (fp32), the mean loss, then backward from the loss (seed 1.0)."""
    h, v = shapes["hidden_size"], shapes["vocab_size"]
    return [TensorSpec("intermediate.logits", (tokens, v), "output"),
            TensorSpec("out", (tokens,), "output", "float32"), TensorSpec("loss", (1,), "output", "float32"),
            TensorSpec("intermediate.grad_logits", (tokens, v), "output"),
            TensorSpec("grad.input", (tokens, h), "output"), TensorSpec("grad.weight", (v, h), "output")]


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
                    _experts_inputs, _experts_outputs, "ffn_hidden_size", ("use_accuracy_compatible",),
                    batch_mixed="each expert's rows are a fixed split of the token count (uneven_split)")
SHARED_EXPERT_MLP = Op("shared_expert_mlp", "mlp_block", ("hidden_size", "ffn_hidden_size"), _mlp_inputs,
                       _mlp_outputs, "ffn_hidden_size", ("swiglu_impl", "use_accuracy_compatible"),
                       stages=_mlp_stages)
# MLA's q/kv up-projections (q_b: q_lora -> heads x (nope + rope); kv_b: kv_lora -> heads x (nope + v)).
MLA_UP_PROJECTION = Op("mla_up_projection", "mla_up_projection", ("lora_rank", "num_heads", "head_dim"),
                       _up_projection_inputs, _up_projection_outputs, "num_heads", ("use_accuracy_compatible",),
                       _up_projection_partition, oracle="linear", reduced=("grad.input",))

YARN_KNOBS = ("rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "use_accuracy_compatible")
# YaRN rotary embedding on MLA's rope parts (q_pe, k_pe: 64 of the 192 query/key dims). No oracle: cos and sin are
# not sums of products, and both frameworks round the table to the input dtype before using it.
YARN_ROPE = Op("yarn_rope", "rope", ("num_heads", "rope_dim"), _rope_inputs, _rope_outputs, "num_heads", YARN_KNOBS)
# Core attention end to end: QK^T * scale, causal mask, fp32 softmax, probabilities x V. No oracle (softmax).
CORE_ATTENTION = Op("core_attention", "core_attention", ("num_heads", "head_dim", "v_head_dim"),
                    _core_attention_inputs, _core_attention_outputs, "num_heads",
                    ("softmax_scale", "use_accuracy_compatible"), _core_attention_partition)
# MoE combine: unpermute (sum of each token's k routed outputs) plus the shared expert's output.
MOE_COMBINE = Op("moe_combine", "moe_combine", ("hidden_size", "num_experts", "topk"), _combine_inputs,
                 _combine_outputs, "hidden_size", ("use_accuracy_compatible",), oracle="moe_combine",
                 batch_mixed="its expert outputs are in expert-major order over all the rows")
# Output layer (vocab-parallel logits) and the language-model loss (mean cross entropy). The oracle covers the
# logits only (the loss is not a sum of products).
LM_HEAD_LOSS = Op("lm_head_loss", "lm_head", ("hidden_size", "vocab_size"), _lm_head_inputs, _lm_head_outputs,
                  "vocab_size", ("use_accuracy_compatible",), oracle="lm_head",
                  batch_mixed="the loss is a mean over the rows")

OPS: dict[str, Op] = {op.name: op for op in (
    COLUMN_PARALLEL_LINEAR, ROW_PARALLEL_LINEAR, RMS_NORM, SWIGLU, EMBEDDING, MOE_ROUTER, ATTENTION_SCORES,
    ROUTED_EXPERTS, SHARED_EXPERT_MLP, MLA_UP_PROJECTION, YARN_ROPE, CORE_ATTENTION, MOE_COMBINE, LM_HEAD_LOSS,
)}


# --- the model level: a whole causal LM (docs/model-contract.md) ----------------------------------------------------
# Shapes come from the case's model config (its family's record: harness/families/), every default resolved by the
# registry. An op record is handed the wire config; `model_config` reads its `model` once.

NORM_DIST = {"dist": "normal", "mean": 1.0, "std": 0.02}  # RMSNorm weights near 1
BUFFER_DIST = {"dist": "normal", "mean": 0.0, "std": 0.01}  # a buffer (the routing bias): small, float32


def _causal_lm_inputs(shapes, tokens, config):
    m = model_config(config["model"])
    specs = []
    for name, shape, kind in m.record.parameters(m):
        if kind == "buffer":
            specs.append(TensorSpec(name, shape, "weight", FLOAT32_OR_WIDER, default_dist=BUFFER_DIST))
        elif kind == "hash":  # a hash layer's expert table: each token's experts, drawn from [0, experts)
            specs.append(TensorSpec(name, shape, "weight", "int64", high=m.record.routed_experts(m)))
        else:
            specs.append(TensorSpec(name, shape, "weight", default_dist=NORM_DIST if kind == "norm" else None))
    return specs + [TensorSpec("input_ids", (tokens,), "ids", "int64", high=m.vocab_size),
                    TensorSpec("labels", (tokens,), "labels", "int64")]


def _causal_lm_outputs(shapes, tokens, config):
    """Forward (module outputs, logits, loss), then backward (every parameter gradient): topological order."""
    m = model_config(config["model"])
    family = m.record
    loss_dtype = FLOAT32_OR_WIDER
    return [*family.modules(m, tokens), TensorSpec("logits", (tokens, m.vocab_size), "output"),
            TensorSpec("loss", (), "output", loss_dtype),
            *(TensorSpec(name, shape, "output") for name, shape in family.gradients(m))]


# The whole model: TP=1 (tp_split_field None); its one knob is the model config (harness/families/).
CAUSAL_LM = Op("causal_lm", "model", (), _causal_lm_inputs, _causal_lm_outputs, None, ("model",), level="model")
OPS[CAUSAL_LM.name] = CAUSAL_LM


# --- the training level: N optimizer steps of the whole causal LM (docs/training.md) --------------------------------
# `config["train"]` is the case's training settings as the request carries them (harness/case/train_settings.py: steps,
# micro_batches, master_weights, the optimizer, ...). Per step k (1-based) and micro-batch m: inputs
# `step{k}.mb{m}.input_ids` / `.labels`; outputs in the order a step makes them and the report reads them: the lr the
# step used, each micro-batch's loss as backpropagated (its mean cross entropy / micro_batches), the accumulated
# gradient the optimizer starts from (before clipping), the global norm, the clip factor the gradients were multiplied
# by (1 when not clipped), the optimizer's state (the quantities its record names, harness.optimizers), the fp32
# masters (bf16 cases), the parameters, each MoE layer's routing bias as the next step reads it. State tensors use the
# canonical gradient names (gate and up fused); the routing bias its checkpoint name.


def step_quantities(optimizer: Optimizer) -> tuple[str, ...]:
    """Every quantity a training step writes, in the order it makes them (the report's order within a step)."""
    return ("lr", "loss", "grad", "grad_norm", "clip_coeff", *optimizer.state, "master", "param", "expert_bias")


def state_quantities(optimizer: Optimizer) -> tuple[str, ...]:
    """The quantities a step writes per parameter, in the step's order."""
    return ("grad", *carried_quantities(optimizer))


def carried_quantities(optimizer: Optimizer) -> tuple[str, ...]:
    """What a step hands to the next per parameter (a re-feed loads them; the gradients are made again)."""
    return (*optimizer.state, "master", "param")


def train_buffer_names(m) -> list[tuple[str, tuple[int, ...]]]:
    """The buffers training may change (`m`: the model's config, typed or a request's dict): each MoE layer's routing
    bias (Megatron updates it after every step: aux-loss-free load balancing; HF's and Paddle's training code leave
    it)."""
    m = model_config(m)
    return m.record.buffers(m)


def train_state_names(m) -> list[tuple[str, tuple[int, ...]]]:
    """(canonical parameter name, shape) of every trained parameter: the gradient names without "grad."."""
    m = model_config(m)
    return [(name[len("grad."):], shape) for name, shape in m.record.gradients(m)]


def train_step_outputs(m, train: TrainSettings, step: int) -> list[TensorSpec]:
    wide = FLOAT32_OR_WIDER
    states = train_state_names(m)
    p = f"step{step}."
    specs = [TensorSpec(p + "lr", (), "output", "float64"),
             TensorSpec(p + "loss", (train.micro_batches,), "output", wide)]
    specs += [TensorSpec(f"{p}grad.{name}", shape, "output", wide) for name, shape in states]
    # At the gradients' precision, the one a stack applies them at (Megatron's doubles are shown beside them). Without
    # clipping no stack multiplies by a factor, and only Megatron computes a norm: the others write none of their own.
    clipped = train.clip_grad > 0
    specs.append(TensorSpec(p + "grad_norm", (), "output", wide, optional=not clipped))
    specs += [TensorSpec(p + "clip_coeff", (), "output", wide)] if clipped else []
    for quantity in train.record.state:
        specs += [TensorSpec(f"{p}{quantity}.{name}", shape, "output", wide) for name, shape in states]
    if train.master_weights:
        specs += [TensorSpec(f"{p}master.{name}", shape, "output", "float32") for name, shape in states]
    specs += [TensorSpec(f"{p}param.{name}", shape, "output") for name, shape in states]
    biases = train_buffer_names(m)
    return specs + [TensorSpec(f"{p}expert_bias.{name}", shape, "output", wide) for name, shape in biases]


def _causal_lm_train_inputs(shapes, tokens, config):
    m, train = model_config(config["model"]), TrainSettings.from_dict(config["train"])
    specs = [s for s in _causal_lm_inputs(shapes, tokens, config) if s.role not in ("ids", "labels")]
    for step in range(1, train.steps + 1):
        for mb in range(train.micro_batches):
            p = f"step{step}.mb{mb}."
            specs += [TensorSpec(p + "input_ids", (tokens,), "ids", "int64", high=m.vocab_size),
                      TensorSpec(p + "labels", (tokens,), "labels", "int64")]
    return specs


def _causal_lm_train_outputs(shapes, tokens, config):
    m, train = model_config(config["model"]), TrainSettings.from_dict(config["train"])
    return [spec for step in range(1, train.steps + 1) for spec in train_step_outputs(m, train, step)]


CAUSAL_LM_TRAIN = Op("causal_lm_train", "train", (), _causal_lm_train_inputs, _causal_lm_train_outputs, None,
                     ("model",), level="train", tables=("train",))
OPS[CAUSAL_LM_TRAIN.name] = CAUSAL_LM_TRAIN
