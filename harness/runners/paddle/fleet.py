"""Level 1 of the Paddle side: PaddleFleet with the case's ``use_accuracy_compatible`` (``IMPLEMENTATIONS``, keyed
by the op record). GPU only, where ``paddlefleet`` imports.

Written against PaddleFleet's public source (PaddlePaddle/PaddleFleet, read through the project's code index; its
snapshot cannot be fetched), file by file at the commit read. ``PATHS`` says, per op, whether the harness calls
PaddleFleet's own module end to end (``module``), one of its functions as the cited module calls it (``function``), or
composes several PaddleFleet pieces in its own way (``composition``), and names each piece, file and commit; the
runner writes it to meta.json as ``paddle_source``.

None of it has run on real PaddleFleet: no Paddle 3.x GPU build or PaddleFleet can be installed on this project's
machines. Every path is checked against a stand-in ``paddlefleet`` package written from the cited source
(``tests/support/paddlefleet_stand_in``, a test double: class names, constructor arguments, forward signatures;
``tests/test_fleet_contract.py``), and every report at this level says so (``STAND_IN_ONLY``). On a CPU
``unavailable`` answers why, and the side is UNSUPPORTED.
"""

from __future__ import annotations

import importlib
import sys
from functools import cache
from typing import NamedTuple

import numpy as np
import paddle

from harness.case import ops
from harness.run.protocol import rank_and_world
from harness.runners.paddle.common import as_tensor, set_param, sync, transposed

LABEL = "PaddleFleet"
STAND_IN_ONLY = ("checked against a stand-in paddlefleet package only (tests/support/paddlefleet_stand_in), never "
                 "run on real PaddleFleet")

LAYERS = "src/paddlefleet/tensor_parallel/layers.py@021152f8ba60d370b43f7e110fdbabe75e873b13"
NORM = "src/paddlefleet/transformer/paddle_norm.py@0534a45160925fcef9a133986ce3655f04cc997e"
MLP = "src/paddlefleet/transformer/mlp.py@9f9bd7b9952d3cbfdd48f80138cf4d794c753979"
SWIGLU = "src/paddlefleet/fusions/fused_bias_swiglu.py@d522e07b5b81991b306b74cac0ba232a21c69d52"
SOFTMAX = "src/paddlefleet/fusions/fused_softmax.py@3ca20b50f66310b722b2b507d54830b82da1c950"
ATTENTION = "src/paddlefleet/transformer/dot_product_attention.py@00a9f175a76aa0dc93c445746a3c90efa5566069"
ROUTER = "src/paddlefleet/transformer/moe/moe_router.py@01ae3ccf6d11a45944a64f77baa4cf1eb60a486e"
MLA = "src/paddlefleet/transformer/multi_latent_attention.py@023ee66c6bd20101d946d14fef24588df4d515ac"


class FleetPath(NamedTuple):
    """How one op reaches PaddleFleet: `kind` (module, function or composition), `calls` (the PaddleFleet names it
    calls, itself or through the modules it builds: the contract test checks them), `pieces` (each with its
    file@commit, for the reader)."""

    kind: str
    calls: tuple[str, ...]
    pieces: tuple[str, ...]


TP = "paddlefleet.tensor_parallel."
FUSED_SWIGLU = "paddlefleet.fusions.fused_bias_swiglu."
PATHS = {
    ops.COLUMN_PARALLEL_LINEAR: FleetPath("module", (TP + "ColumnParallelLinear",),
                                          (f"{TP}ColumnParallelLinear ({LAYERS})",)),
    ops.ROW_PARALLEL_LINEAR: FleetPath("module", (TP + "RowParallelLinear",), (f"{TP}RowParallelLinear ({LAYERS})",)),
    ops.RMS_NORM: FleetPath("module", ("paddlefleet.transformer.paddle_norm.WrappedPaddleNorm",
                                       "paddlefleet.transformer.paddle_norm.RMSNorm"),
                            (f"paddlefleet.transformer.paddle_norm.WrappedPaddleNorm -> RMSNorm ({NORM})",)),
    ops.SWIGLU: FleetPath("function", (FUSED_SWIGLU + "bias_swiglu_impl", FUSED_SWIGLU + "weighted_bias_swiglu_impl"),
                          (f"{FUSED_SWIGLU}bias_swiglu_impl, or with a per-token scale weighted_bias_swiglu_impl "
                           f"({SWIGLU}), with the arguments MLP.forward passes them ({MLP})",)),
    ops.EMBEDDING: FleetPath("module", (TP + "VocabParallelEmbedding",), (f"{TP}VocabParallelEmbedding ({LAYERS})",)),
    ops.MOE_ROUTER: FleetPath("module", ("paddlefleet.transformer.moe.moe_router.TopKRouter",),
                              (f"paddlefleet.transformer.moe.moe_router.TopKRouter ({ROUTER})",)),
    ops.ATTENTION_SCORES: FleetPath(
        "composition", ("paddlefleet.fusions.fused_softmax.FusedScaleMaskSoftmax",
                        "paddlefleet.transformer.utils.attention_mask_func"),
        (f"paddle.baddbmm(beta=0, alpha=1/sqrt(d)) as DotProductAttention.forward's explicit path writes it "
         f"({ATTENTION}; DotProductAttention itself is not called: in bf16 it takes a fused kernel that exposes no "
         "probabilities)",
         f"paddlefleet.fusions.fused_softmax.FusedScaleMaskSoftmax with paddlefleet.transformer.utils."
         f"attention_mask_func, causal ({SOFTMAX})")),
    ops.SHARED_EXPERT_MLP: FleetPath(
        "module", ("paddlefleet.transformer.mlp.MLP", TP + "ColumnParallelLinear", TP + "RowParallelLinear",
                   FUSED_SWIGLU + "bias_swiglu_impl"),
        (f"paddlefleet.transformer.mlp.MLP ({MLP}) with bias_activation_fusion: ColumnParallelLinear, "
         f"bias_swiglu_impl, RowParallelLinear ({LAYERS}, {SWIGLU})",)),
    ops.ROUTED_EXPERTS: FleetPath(
        "composition", ("paddlefleet.transformer.mlp.MLP", TP + "ColumnParallelLinear", TP + "RowParallelLinear",
                        FUSED_SWIGLU + "weighted_bias_swiglu_impl"),
        (f"one paddlefleet.transformer.mlp.MLP(is_expert=True) per local expert, called with per_token_scale ({MLP})",
         "tokens split by harness.case.ops.uneven_split (PaddleFleet's MoE layer and its expert node, which the "
         "recipe follows, are not called)")),
    ops.MLA_UP_PROJECTION: FleetPath(
        "composition", (TP + "ColumnParallelLinear",),
        (f"{TP}ColumnParallelLinear ({LAYERS}) as q_up_proj / kv_up_proj ({MLA})", "output viewed as [tokens, heads, "
         "head_dim]")),
}
KINDS = {"module": "calls PaddleFleet's own module", "function": "calls PaddleFleet's own function",
         "composition": "composes PaddleFleet pieces the harness's way"}


def source(request) -> str:
    """What this op's path calls (meta.json ``paddle_source``), and that it was checked against a stand-in only."""
    path = PATHS[ops.OPS[request["op"]]]
    return f"{KINDS[path.kind]}: {'; then '.join(path.pieces)}. {STAND_IN_ONLY}"


@cache
def _import_problem() -> str | None:
    try:
        importlib.import_module("paddlefleet")
    except Exception as error:  # noqa: BLE001 - any import failure makes the level unavailable, with its reason
        return (f"paddlefleet is not importable by {sys.executable} ({type(error).__name__}: {error}); PaddleFleet "
                "and paddlefleet-ops come from Paddle's own package index, next to paddlepaddle-gpu >= 3.3")
    return None


def versions() -> dict:
    if _import_problem():
        return {}
    import paddlefleet

    return {"paddlefleet": getattr(paddlefleet, "__version__", "unknown")}


def unavailable(request: dict) -> str | None:
    """Why PaddleFleet's module cannot run this request here, or None."""
    reasons = []
    if request["device"] != "gpu":
        reasons.append("PaddleFleet runs on a GPU only (its modules call CUDA kernels: fused_rms_norm_ext, swiglu, "
                       "fused_linear, flash attention); this is a CPU run")
    elif not paddle.is_compiled_with_cuda():
        reasons.append(f"paddle {paddle.__version__} at {paddle.__file__} is a CPU build")
    problem = _import_problem()
    if problem:
        reasons.append(problem)
    return "; ".join(reasons) or None


def _config(request, gate, **fields):
    from paddlefleet.transformer.transformer_config import TransformerConfig

    dtype = {"bfloat16": paddle.bfloat16, "float16": paddle.float16}.get(request["dtype"], paddle.float32)
    fields.setdefault("num_attention_heads", 1)
    return TransformerConfig(num_layers=1, params_dtype=dtype, use_accuracy_compatible=gate,
                             gradient_accumulation_fusion=False, bf16=request["dtype"] == "bfloat16",
                             fp16=request["dtype"] == "float16", tensor_model_parallel_size=rank_and_world()[1],
                             **fields)


def _run(request, phases, forward, backward):
    with phases("forward"):
        out = forward()
        sync(request)
    with phases("backward"):
        backward(out)
        sync(request)
    return out


def _name(text, request, gate):
    kind = KINDS[PATHS[ops.OPS[request["op"]]].kind]
    return (f"{kind}: {text} (use_accuracy_compatible={gate}; PaddleFleet {versions().get('paddlefleet')}; "
            f"{STAND_IN_ONLY})")


def linear(request, tensors, gate, phases, guard):
    """ColumnParallelLinear / RowParallelLinear (LAYERS), input [s, b=1, h], weight [in, out] (this rank's shard at
    TP > 1, on fleet's model-parallel group)."""
    from paddlefleet.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    world = rank_and_world()[1]
    n_in, n_out = request["shapes"]["input_size"], request["shapes"]["output_size"]
    bias = "bias" in tensors
    # gradient_accumulation_fusion off: the wgrad is general_gemm(x.t(), dy) into .grad, as on Megatron's side
    config = _config(request, gate, hidden_size=n_in, sequence_parallel=request["config"]["sequence_parallel"])
    group = {"tp_group": _tp_group(world)} if world > 1 else {}
    if request["op"] == "column_parallel_linear":
        layer = ColumnParallelLinear(n_in, n_out, config=config, init_method=lambda t: t, bias=bias,
                                     gather_output=False, **group)
    else:
        layer = RowParallelLinear(n_in, n_out, config=config, init_method=lambda t: t, bias=bias,
                                  input_is_parallel=True, skip_bias_add=False, **group)
    set_param(layer.weight, transposed(tensors["weight"]))
    if bias:
        set_param(layer.bias, tensors["bias"])
    x = as_tensor(tensors["input"][:, None])  # [tokens, batch=1, hidden]: the [s, b, h] both libraries expect
    out = _run(request, phases, lambda: layer(x)[0],
               lambda o: o.backward(as_tensor(tensors["grad_output"][:, None], False)))
    outputs = {"out": out[:, 0].numpy(), "grad.input": x.grad[:, 0].numpy(),
               "grad.weight": transposed(layer.weight.grad.numpy())}
    if bias:
        outputs["grad.bias"] = layer.bias.grad.numpy()
    return outputs, _name(f"paddlefleet.tensor_parallel.{type(layer).__name__}", request, gate)


def _tp_group(world):
    """Fleet's hybrid topology with every rank in one model-parallel (tensor-parallel) group."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def rms_norm(request, tensors, gate, phases, guard):
    """WrappedPaddleNorm(config, hidden, eps) -> paddle_norm.RMSNorm: fused_rms_norm_ext, cast to the weight dtype."""
    from paddlefleet.transformer.paddle_norm import WrappedPaddleNorm

    h = request["shapes"]["hidden_size"]
    config = _config(request, gate, hidden_size=h, normalization="RMSNorm")
    before = paddle.get_default_dtype()
    paddle.set_default_dtype(request["dtype"])  # RMSNorm creates its weight in the default dtype
    try:
        norm = WrappedPaddleNorm(config, h, request["config"]["eps"])
    finally:
        paddle.set_default_dtype(before)
    set_param(norm.weight, tensors["weight"])
    x = as_tensor(tensors["input"][:, None])
    out = _run(request, phases, lambda: norm(x), lambda o: o.backward(as_tensor(tensors["grad_output"][:, None],
               False)))
    return ({"out": out[:, 0].numpy(), "grad.input": x.grad[:, 0].numpy(), "grad.weight": norm.weight.grad.numpy()},
            _name("paddlefleet.transformer.paddle_norm.RMSNorm (fused_rms_norm_ext)", request, gate))


def _swiglu(gate, x, scale):
    """The SwiGLU MLP.forward (MLP) calls with bias_activation_fusion, no bias and no clamp: its arguments."""
    from paddlefleet.fusions import fused_bias_swiglu as fused

    if scale is None:
        return fused.bias_swiglu_impl(x, None, fp8_input_store=False, cpu_offload_input=False, clamp_value=None,
                                      use_accuracy_compatible=gate), "bias_swiglu_impl"
    return fused.weighted_bias_swiglu_impl(x, None, scale.unsqueeze(-1), False, None,
                                           use_accuracy_compatible=gate), "weighted_bias_swiglu_impl"


def swiglu(request, tensors, gate, phases, guard):
    """The SwiGLU of mlp.MLP.forward (with per_token_scale when the case has one)."""
    x = as_tensor(tensors["input"])
    scale = as_tensor(tensors["per_token_scale"]) if "per_token_scale" in tensors else None
    used = []

    def forward():
        out, name = _swiglu(gate, x, scale)
        used.append(name)
        return out

    out = _run(request, phases, forward, lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    outputs = {"out": out.numpy(), "grad.input": x.grad.numpy()}
    if scale is not None:
        outputs["grad.per_token_scale"] = scale.grad.numpy()
    return outputs, _name(f"paddlefleet.fusions.fused_bias_swiglu.{used[0]}", request, gate)


def embedding(request, tensors, gate, phases, guard):
    """tensor_parallel.VocabParallelEmbedding as LanguageModelEmbedding builds embed_tokens."""
    from paddlefleet import tensor_parallel

    v, h = request["shapes"]["vocab_size"], request["shapes"]["hidden_size"]
    config = _config(request, gate, hidden_size=h)
    layer = tensor_parallel.VocabParallelEmbedding(num_embeddings=v, embedding_dim=h, init_method=lambda t: t,
                                                   reduce_scatter_embeddings=False, config=config)
    set_param(layer.weight, tensors["weight"])
    ids = as_tensor(tensors["ids"][None], False)
    out = _run(request, phases, lambda: layer(ids), lambda o: o.backward(as_tensor(tensors["grad_output"][None],
               False)))
    return ({"out": out[0].numpy(), "grad.weight": layer.weight.grad.numpy()},
            _name("paddlefleet.tensor_parallel.VocabParallelEmbedding", request, gate))


def attention_scores(request, tensors, gate, phases, guard):
    """DotProductAttention's unfused core: baddbmm(alpha = 1/sqrt(d)) then FusedScaleMaskSoftmax (causal, fp32)."""
    from paddlefleet.fusions.fused_softmax import FusedScaleMaskSoftmax
    from paddlefleet.transformer.enums import AttnMaskType
    from paddlefleet.transformer.utils import attention_mask_func

    n, d = request["shapes"]["num_heads"], request["shapes"]["head_dim"]
    q, k = as_tensor(tensors["query"]), as_tensor(tensors["key"])
    t = tensors["query"].shape[0]
    softmax = FusedScaleMaskSoftmax(input_in_fp16=request["dtype"] == "float16",
                                    input_in_bf16=request["dtype"] == "bfloat16", attn_mask_type=AttnMaskType.causal,
                                    scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                                    softmax_in_fp32=True, scale=None)
    captured = {}

    def forward():
        query = q.transpose([1, 0, 2])  # [b * np, sq, hn] with b = 1
        key = k.transpose([1, 2, 0])  # [b * np, hn, sk]
        buffer = paddle.empty([n, t, t], dtype=query.dtype)
        scores = paddle.baddbmm(buffer, query, key, beta=0.0, alpha=1.0 / d ** 0.5)
        captured["intermediate.scores"] = scores.numpy()
        return softmax(scores.reshape([1, n, t, t]), None)[0]

    out = _run(request, phases, forward, lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    return ({**captured, "out": out.numpy(), "grad.query": q.grad.numpy(), "grad.key": k.grad.numpy()},
            _name("paddle.baddbmm (as DotProductAttention's explicit path) + paddlefleet.fusions.FusedScaleMaskSoftmax "
                  "(causal, softmax in fp32)", request, gate))


def router_fields(hidden: int, experts: int, topk: int, scaling: float) -> dict:
    """PaddleFleet's ``TransformerConfig`` keywords for its ``moe_router.TopKRouter`` as DeepSeek-V3 routes
    (noaux_tc, sigmoid, expert bias, normalised top-k, the case's scaling; no aux or z loss)."""
    return {"hidden_size": hidden, "n_routed_experts": experts, "num_experts_per_tok": topk,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": scaling, "router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}


def moe_router(request, tensors, gate, phases, guard):
    """moe_router.TopKRouter as DeepSeek-V3 routes (``router_fields``: sigmoid, expert bias, no aux
    or z loss)."""
    from paddlefleet.transformer.moe.moe_router import TopKRouter

    h, e, k = (request["shapes"][n] for n in ("hidden_size", "num_experts", "topk"))
    config = _config(request, gate, init_method=lambda t: t,
                     **router_fields(h, e, k, request["config"]["topk_scaling_factor"]))
    router = TopKRouter(config)
    set_param(router.weight, tensors["weight"])  # [experts, hidden]: params dtype under the gate, fp32 otherwise
    router.e_score_correction_bias.set_value(paddle.to_tensor(tensors["expert_bias"]))
    x = as_tensor(tensors["input"][None])

    def forward():
        result = router(x)
        return result[3], result[2]  # probs [tokens, experts], top_idx [tokens, k]

    probs, chosen = _run(request, phases, forward, lambda o: o[0].backward(as_tensor(tensors["grad_probs"], False)))
    dtype = paddle.to_tensor(tensors["weight"]).dtype
    return ({"topk_indices": np.sort(chosen.numpy().astype(np.int64), axis=-1), "probs": probs.numpy(),
             "grad.input": x.grad[0].numpy(), "grad.weight": router.weight.grad.astype(dtype).numpy()},
            _name("paddlefleet.transformer.moe.moe_router.TopKRouter (noaux_tc, sigmoid, gate_detach_matmul)", request,
                  gate))


def _mlp(request, gate, h, f, is_expert):
    from paddlefleet.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from paddlefleet.transformer.mlp import MLP, MLPSublayersSpec

    # bias_activation_fusion: MLP.forward takes bias_swiglu_impl / weighted_bias_swiglu_impl, passing the gate
    config = _config(request, gate, hidden_size=h, gated_linear_unit=True, hidden_act=paddle.nn.functional.silu,
                     use_bias=False, bias_activation_fusion=True, init_method=lambda t: t,
                     output_layer_init_method=lambda t: t)
    spec = MLPSublayersSpec(up_gate_proj=ColumnParallelLinear, down_proj=RowParallelLinear)
    return MLP(config, spec, is_expert=is_expert, intermediate_size=f)


def shared_expert_mlp(request, tensors, gate, phases, guard):
    """mlp.MLP (up_gate_proj ColumnParallelLinear, SwiGLU, down_proj RowParallelLinear); intermediates captured by
    wrapping, for this call only, the activation function the forward calls."""
    from paddlefleet.transformer import mlp as fleet_mlp

    h, f = request["shapes"]["hidden_size"], request["shapes"]["ffn_hidden_size"]
    block = _mlp(request, gate, h, f, is_expert=False)
    set_param(block.up_gate_proj.weight, transposed(tensors["fc1_weight"]))
    set_param(block.down_proj.weight, transposed(tensors["fc2_weight"]))
    captured = {}

    def keep(name, tensor):
        captured[name] = tensor[:, 0].numpy()
        tensor.register_hook(lambda grad: captured.__setitem__("intermediate.grad_" + name[13:], grad[:, 0].numpy()))

    original = fleet_mlp.bias_swiglu_impl

    def capturing(x, *args, **kwargs):
        keep("intermediate.fc1_out", x)
        out = original(x, *args, **kwargs)
        keep("intermediate.act_out", out)
        return out

    fleet_mlp.bias_swiglu_impl = capturing
    x = as_tensor(tensors["input"][:, None])
    try:
        out = _run(request, phases, lambda: block(x)[0],
                   lambda o: o.backward(as_tensor(tensors["grad_output"][:, None], False)))
    finally:
        fleet_mlp.bias_swiglu_impl = original
    outputs = {**captured, "out": out[:, 0].numpy(), "grad.input": x.grad[:, 0].numpy(),
               "grad.fc1_weight": transposed(block.up_gate_proj.weight.grad.numpy()),
               "grad.fc2_weight": transposed(block.down_proj.weight.grad.numpy())}
    return outputs, _name("paddlefleet.transformer.mlp.MLP (ColumnParallelLinear -> bias_swiglu_impl -> "
                          "RowParallelLinear)", request, gate)


def routed_experts(request, tensors, gate, phases, guard):
    """One mlp.MLP(is_expert=True) per local expert, each called with per_token_scale = its tokens' probabilities."""
    h, f, e = (request["shapes"][n] for n in ("hidden_size", "ffn_hidden_size", "num_local_experts"))
    experts = [_mlp(request, gate, h, f, is_expert=True) for _ in range(e)]
    for i, expert in enumerate(experts):
        set_param(expert.up_gate_proj.weight, transposed(tensors["fc1_weight"][i]))
        set_param(expert.down_proj.weight, transposed(tensors["fc2_weight"][i]))
    counts = ops.uneven_split(tensors["input"].shape[0], e)
    x, probs = as_tensor(tensors["input"]), as_tensor(tensors["probs"])

    def forward():
        pieces = zip(paddle.split(x, counts), paddle.split(probs, counts), experts, strict=True)
        return paddle.concat([expert(tokens, per_token_scale=p)[0] for tokens, p, expert in pieces], axis=0)

    out = _run(request, phases, forward, lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    return ({"out": out.numpy(), "grad.input": x.grad.numpy(), "grad.probs": probs.grad.numpy(),
             "grad.fc1_weight": np.stack([transposed(m.up_gate_proj.weight.grad.numpy()) for m in experts]),
             "grad.fc2_weight": np.stack([transposed(m.down_proj.weight.grad.numpy()) for m in experts])},
            _name(f"paddlefleet.transformer.mlp.MLP(is_expert=True) per expert with per_token_scale, tokens per "
                  f"expert {counts}", request, gate))


def mla_up_projection(request, tensors, gate, phases, guard):
    """q_up_proj / kv_up_proj: PaddleFleet's ColumnParallelLinear, output viewed [tokens, heads, head_dim]."""
    shapes, dy = request["shapes"], tensors["grad_output"]
    as_linear = {**request, "op": "column_parallel_linear",
                 "shapes": {"input_size": shapes["lora_rank"], "output_size": shapes["num_heads"] * shapes["head_dim"]},
                 "config": {**request["config"], "bias": False, "sequence_parallel": False}}
    outputs, _ = linear(as_linear, {**tensors, "grad_output": dy.reshape(dy.shape[0], -1)}, gate, phases, guard)
    outputs["out"] = outputs["out"].reshape(dy.shape)
    return outputs, _name("paddlefleet.tensor_parallel.ColumnParallelLinear, output viewed as [tokens, heads, "
                          "head_dim] (multi_latent_attention.py)", request, gate)


IMPLEMENTATIONS = {
    ops.COLUMN_PARALLEL_LINEAR: linear, ops.ROW_PARALLEL_LINEAR: linear, ops.RMS_NORM: rms_norm, ops.SWIGLU: swiglu,
    ops.EMBEDDING: embedding, ops.MOE_ROUTER: moe_router, ops.ATTENTION_SCORES: attention_scores,
    ops.SHARED_EXPERT_MLP: shared_expert_mlp, ops.ROUTED_EXPERTS: routed_experts,
    ops.MLA_UP_PROJECTION: mla_up_projection,
}
