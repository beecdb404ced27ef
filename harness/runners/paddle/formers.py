"""Level 2 of the Paddle side: PaddleFormers' own modules (``IMPLEMENTATIONS``, keyed by the op record).

Written against the installed ``paddleformers`` 1.2.0 (PyPI): ``paddleformers/transformers/deepseek_v3/modeling.py``
(Kimi-K2's architecture: ``DeepseekV3TopkRouter``, ``DeepseekV3MoE``,
``DeepseekV3Model._prepare_decoder_attention_mask``,
the attention's q/kv up-projections) and the shared modules it is built from: ``paddleformers/nn/norm.py``
(``RMSNorm``), ``nn/mlp.py`` (``MLP``, the shared and routed experts), ``nn/linear.py`` (``Linear.create``: a plain
``paddle.nn.Linear`` at TP=1), ``nn/embedding.py`` (``Embedding.create``: ``paddle.nn.Embedding`` at TP=1) and
``nn/attention/eager_attention.py`` (``eager_attention_forward``: QK^T * scale + additive mask, softmax in fp32).

Each module is built as the model builds it (a ``DeepseekV3Config`` with the case's sizes, parameters created in the
case's dtype, inputs as ``[batch = 1, tokens, hidden]``), the case's tensors are copied into its parameters, and
forward and backward run in dygraph. Fused paths are used where the config turns them on and the kernel exists on
the device; on a CPU ``fuse_rms_norm`` is off (``fused_rms_norm_ext`` is GPU-only) and ``fuse_swiglu`` keeps its
default (off). PaddleFormers has no accuracy gate: ``use_accuracy_compatible`` is not read at this level.

PaddleFormers imports only with ``paddlefleet_ops``; where the real (GPU-only) package is missing the stand-in of
``harness.runners.paddle.paddlefleet_ops_shim`` (the whole-model runner's) is installed: it changes no computation.

Ops PaddleFormers has no module for say so through ``unavailable`` (SwiGLU times a per-token scale: its MoE
multiplies the routing weight in after ``down_proj``). Tensor parallelism (tp > 1) is not written at this level.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from functools import cache

import numpy as np
import paddle

from harness.case import ops
from harness.runners.paddle import kernels as paddle_kernels
from harness.runners.paddle import paddlefleet_ops_shim
from harness.runners.paddle.common import as_tensor, run_phases, set_param, transposed

LABEL = "PaddleFormers"
SOURCE = "paddleformers 1.2.0: transformers/deepseek_v3/modeling.py, nn/{norm,mlp,linear,embedding}.py, " \
         "nn/attention/eager_attention.py"


def router_fields(hidden: int, experts: int, topk: int, scaling: float) -> dict:
    """PaddleFormers' ``DeepseekV3Config`` keywords for one router op (Kimi-K2's op cases, run through
    ``DeepseekV3TopkRouter``): one group, normalised top-k, the case's scaling."""
    return {"hidden_size": hidden, "n_routed_experts": experts, "num_experts_per_tok": topk, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": scaling}


def experts_fields(hidden: int, ffn: int, experts: int) -> dict:
    """PaddleFormers' ``DeepseekV3Config`` keywords for the routed-experts op (``DeepseekV3MoE`` over its own
    experts; the op passes top-1 routing)."""
    return {"hidden_size": hidden, "moe_intermediate_size": ffn, "intermediate_size": ffn, "n_routed_experts": experts,
            "num_experts_per_tok": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "hidden_act": "silu"}


# Kernels each op needs in the case's dtype at this level (dygraph; casts aside, and the fp32 parts aside: the
# RMSNorm's variance and rsqrt, the router, the attention softmax run in fp32): where one is missing on the device,
# the level is unavailable for the op (Paddle's CPU build has no bf16 matmul or silu).
KERNELS = {
    ops.RMS_NORM: ("multiply",), ops.SWIGLU: ("silu", "multiply"), ops.EMBEDDING: ("embedding",),
    ops.MOE_ROUTER: (), ops.ATTENTION_SCORES: ("matmul",), ops.ROUTED_EXPERTS: ("matmul", "silu"),
    ops.SHARED_EXPERT_MLP: ("matmul", "silu"), ops.COLUMN_PARALLEL_LINEAR: ("matmul",),
    ops.ROW_PARALLEL_LINEAR: ("matmul",), ops.MLA_UP_PROJECTION: ("matmul",),
}


def source(request) -> str:
    """What this level runs (meta.json ``paddle_source``): PaddleFormers' own modules, no accuracy gate."""
    return f"PaddleFormers' own modules ({SOURCE}); PaddleFormers has no accuracy gate"


@cache
def _import_problem() -> str | None:
    try:
        importlib.import_module("paddleformers")
    except Exception as error:  # noqa: BLE001 - any import failure makes the level unavailable, with its reason
        return f"paddleformers is not importable by {sys.executable}: {type(error).__name__}: {error}"
    shim = "stand-in" if paddlefleet_ops_shim.install() else "real"
    try:
        importlib.import_module("paddleformers.transformers.deepseek_v3.modeling")
    except Exception as error:  # noqa: BLE001
        return (f"paddleformers.transformers.deepseek_v3 does not import ({type(error).__name__}: {error}; "
                f"paddlefleet_ops: {shim})")
    return None


def versions() -> dict:
    if _import_problem():
        return {}
    import paddleformers

    stand_in = not paddlefleet_ops_shim.real_package_present()
    return {"paddleformers": getattr(paddleformers, "__version__", "unknown"),
            "paddlefleet_ops": "harness stand-in (harness.runners.paddle.paddlefleet_ops_shim)" if stand_in else "real"}


def unavailable(request: dict) -> str | None:
    """Why PaddleFormers' module cannot run this request here, or None."""
    op = ops.OPS[request["op"]]
    config = request["config"]
    if op is ops.SWIGLU and config.get("per_token_scale", False):
        return ("PaddleFormers has no SwiGLU times a per-token scale: DeepseekV3MoE.moe multiplies each expert's "
                "output by its routing weight after down_proj (expert_output * expert_weights), so no module "
                "computes swiglu(x) * p")
    if request.get("tp", 1) > 1:
        return "tp > 1: PaddleFormers' tensor-parallel layers (fleet's hybrid topology) are not written at this level"
    if request["device"] == "gpu" and not paddle.is_compiled_with_cuda():
        return f"paddle {paddle.__version__} is a CPU build"
    if request["device"] == "cpu":  # a GPU build has every kernel these modules use; checked before the slow import
        missing = paddle_kernels.missing(KERNELS.get(op, ()), request["dtype"], "cpu")
        if missing:
            return missing
    return _import_problem()


def _modules():
    from paddleformers.transformers.deepseek_v3 import DeepseekV3Config, modeling

    return DeepseekV3Config, modeling


def _config(request, **sizes):
    """A DeepseekV3Config with the case's sizes (TP=1), fused RMSNorm only where its kernel exists."""
    config_class, _ = _modules()
    config = config_class(num_hidden_layers=1, vocab_size=sizes.pop("vocab_size", 32), tensor_model_parallel_size=1,
                          fuse_rms_norm=request["device"] == "gpu", **sizes)
    return config


@contextmanager
def _default_dtype(dtype):
    """Parameters are created in the case's dtype, as the model is when loaded in bf16."""
    before = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(before)


def _grad(tensors, name):
    return as_tensor(tensors[name], False)


def _name(text, request):
    return f"{text} (paddleformers {versions().get('paddleformers')}; no accuracy gate: " \
           f"use_accuracy_compatible={request['config'].get('use_accuracy_compatible')} is not read)"


def rms_norm(request, tensors, gate, phases, guard):
    """``paddleformers.nn.norm.RMSNorm`` (``Norm.create(config, norm_type="rms_norm")``, as the decoder builds its
    layernorms): fused_rms_norm_ext with ``fuse_rms_norm``; else x * rsqrt(mean(x_fp32^2) + eps), cast to the weight
    dtype, times the weight in that dtype."""
    _, modeling = _modules()
    h = request["shapes"]["hidden_size"]
    config = _config(request, hidden_size=h, rms_norm_eps=request["config"]["eps"])
    with _default_dtype(request["dtype"]):
        norm = modeling.GeneralNorm.create(config=config, norm_type="rms_norm")
    set_param(norm.weight, tensors["weight"])
    x = as_tensor(tensors["input"][None])
    out = run_phases(request, phases, guard, "paddleformers RMSNorm", lambda: norm(x),
               lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    path = "fused_rms_norm_ext" if config.fuse_rms_norm else "unfused: fp32 variance, rsqrt * x, cast, * weight"
    return ({"out": out[0].numpy(), "grad.input": x.grad[0].numpy(), "grad.weight": norm.weight.grad.numpy()},
            _name(f"paddleformers.nn.norm.RMSNorm ({path})", request))


def swiglu(request, tensors, gate, phases, guard):
    """The SwiGLU of ``paddleformers.nn.mlp.MLP.forward`` with ``fuse_up_gate=True`` (``gate, x = up_gate(x).chunk(2)``,
    ``act_fn(gate) * x``, or ``paddle.nn.functional.swiglu`` with ``fuse_swiglu``): the module's own forward, with
    its two projections replaced by identities so only the activation remains."""
    _, modeling = _modules()
    f = request["shapes"]["ffn_hidden_size"]
    config = _config(request, hidden_size=2 * f, intermediate_size=f, hidden_act="silu")
    with _default_dtype(request["dtype"]):
        mlp = modeling.DeepseekV3MLP(config, hidden_size=8, intermediate_size=f, fuse_up_gate=True)
    mlp.up_gate_proj, mlp.down_proj = paddle.nn.Identity(), paddle.nn.Identity()
    x = as_tensor(tensors["input"][None])
    out = run_phases(request, phases, guard, "paddleformers MLP activation", lambda: mlp(x),
               lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    act = "paddle.nn.functional.swiglu" if mlp.fuse_swiglu else f"{type(mlp.act_fn).__name__}(gate) * up"
    return ({"out": out[0].numpy(), "grad.input": x.grad[0].numpy()},
            _name(f"paddleformers.nn.mlp.MLP.forward activation ({act}; projections replaced by identities)",
                  request))


def embedding(request, tensors, gate, phases, guard):
    """``paddleformers.nn.embedding.Embedding.create`` as DeepseekV3Model builds ``embed_tokens``: a
    ``paddle.nn.Embedding`` at TP=1 (F.embedding forward, its own backward)."""
    _, modeling = _modules()
    v, h = request["shapes"]["vocab_size"], request["shapes"]["hidden_size"]
    config = _config(request, hidden_size=h, vocab_size=v)
    with _default_dtype(request["dtype"]):
        layer = modeling.GeneralEmbedding.create(config=config, num_embeddings=v, embedding_dim=h)
    set_param(layer.weight, tensors["weight"])
    ids = as_tensor(tensors["ids"][None], False)
    out = run_phases(request, phases, guard, "paddleformers Embedding", lambda: layer(ids),
               lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    return ({"out": out[0].numpy(), "grad.weight": layer.weight.grad.numpy()},
            _name(f"paddleformers.nn.embedding.Embedding.create -> {type(layer).__module__}.{type(layer).__name__}",
                  request))


def moe_router(request, tensors, gate, phases, guard):
    """``DeepseekV3TopkRouter``: F.linear in fp32 on its fp32 weight ``[hidden, experts]``, sigmoid, top-k of
    scores + expert bias (one group: ``router_fields``), gather, normalise (+1e-20), x the scaling.
    It returns (indices, weights [tokens, k]); the harness scatters the weights into the canonical dense
    ``probs`` (put_along_axis: exact) and sorts the indices. The bf16 weight is copied into the fp32 parameter
    (exact); its fp32 grad is cast back to the case's dtype once."""
    _, modeling = _modules()
    h, e, k = (request["shapes"][n] for n in ("hidden_size", "num_experts", "topk"))
    config = _config(request, **router_fields(h, e, k, request["config"]["topk_scaling_factor"]))
    router = modeling.DeepseekV3TopkRouter(config)
    set_param(router.weight, transposed(paddle.to_tensor(tensors["weight"]).astype("float32").numpy()))  # exact
    router.e_score_correction_bias.set_value(paddle.to_tensor(tensors["expert_bias"]))
    x = as_tensor(tensors["input"][None])

    def forward():
        indices, weights = router(x)
        dense = paddle.put_along_axis(paddle.zeros([indices.shape[0], e], dtype=weights.dtype), indices, weights,
                                      axis=-1)
        return dense, indices

    probs, chosen = run_phases(request, phases, guard, "paddleformers DeepseekV3TopkRouter", forward,
                         lambda o: o[0].backward(_grad(tensors, "grad_probs")))
    grad_weight = router.weight.grad.astype(paddle.to_tensor(tensors["weight"]).dtype).numpy()
    return ({"topk_indices": np.sort(chosen.numpy().astype(np.int64), axis=-1), "probs": probs.numpy(),
             "grad.input": x.grad[0].numpy(), "grad.weight": transposed(grad_weight)},
            _name("paddleformers.transformers.deepseek_v3.DeepseekV3TopkRouter (fp32 F.linear, sigmoid, top-k on "
                  "scores + bias, normalise, x routed_scaling_factor); weights scattered to dense probs", request))


def attention_scores(request, tensors, gate, phases, guard):
    """``paddleformers.nn.attention.eager_attention_forward`` (the ``eager`` attention DeepseekV3 calls when flash
    attention is off): ``matmul(q, k^T) * scaling`` + the model's additive causal mask
    (``DeepseekV3Model._prepare_decoder_attention_mask``: 0 / finfo.min), ``softmax(dtype=float32)`` cast back to the
    query's dtype; its returned attention weights are the op's ``out``. ``intermediate.scores`` is the same
    expression evaluated again (the function exposes no hook before the mask); value is zeros (its product unused)."""
    _, modeling = _modules()
    from paddleformers.nn.attention.eager_attention import eager_attention_forward

    d = request["shapes"]["head_dim"]
    t = tensors["query"].shape[0]
    q, k = as_tensor(tensors["query"]), as_tensor(tensors["key"])
    dtype = q.dtype
    mask = modeling.DeepseekV3Model._prepare_decoder_attention_mask(None, (1, t), 0, dtype)
    scaling = d ** -0.5
    captured = {}

    def forward():
        query, key = q.transpose([1, 0, 2])[None], k.transpose([1, 0, 2])[None]  # [1, heads, tokens, dim]
        value = paddle.zeros_like(query)
        value.stop_gradient = True
        captured["intermediate.scores"] = (paddle.matmul(query, key.transpose([0, 1, 3, 2])) * scaling)[0].numpy()
        _, weights = eager_attention_forward(paddle.nn.Layer(), query, key, value, attention_mask=mask, dropout=0.0,
                                             scaling=scaling)
        return weights[0]

    out = run_phases(request, phases, guard, "paddleformers eager_attention_forward", forward,
               lambda o: o.backward(_grad(tensors, "grad_output")))
    return ({**captured, "out": out.numpy(), "grad.query": q.grad.numpy(), "grad.key": k.grad.numpy()},
            _name("paddleformers.nn.attention.eager_attention.eager_attention_forward (matmul * scaling + additive "
                  "causal mask finfo.min, softmax in fp32, cast back)", request))


def _mlp(request, h, f):
    _, modeling = _modules()
    config = _config(request, hidden_size=h, moe_intermediate_size=f, intermediate_size=f, hidden_act="silu")
    with _default_dtype(request["dtype"]):
        return modeling.DeepseekV3MLP(config, intermediate_size=f, fuse_up_gate=False)


def _load_mlp(mlp, fc1, fc2, f):
    """Megatron's fc1 [2f, h] = cat(gate, up) rows -> gate_proj / up_proj [h, f]; fc2 [h, f] -> down_proj [f, h]."""
    set_param(mlp.gate_proj.weight, transposed(fc1[:f]))
    set_param(mlp.up_proj.weight, transposed(fc1[f:]))
    set_param(mlp.down_proj.weight, transposed(fc2))


def _fc1_grad(mlp):
    return np.concatenate([transposed(mlp.gate_proj.weight.grad.numpy()), transposed(mlp.up_proj.weight.grad.numpy())],
                          axis=0)


def shared_expert_mlp(request, tensors, gate, phases, guard):
    """The shared expert as ``DeepseekV3MoE`` builds it: ``DeepseekV3MLP(config, intermediate_size=moe_intermediate
    * n_shared, fuse_up_gate=False)``: separate gate_proj and up_proj GEMMs (nn.Linear), act(gate) * up, down_proj.
    Intermediates are taken with layer hooks: fc1_out = cat(gate_proj out, up_proj out), act_out = down_proj's input."""
    h, f = request["shapes"]["hidden_size"], request["shapes"]["ffn_hidden_size"]
    mlp = _mlp(request, h, f)
    _load_mlp(mlp, tensors["fc1_weight"], tensors["fc2_weight"], f)
    x = as_tensor(tensors["input"][None])
    seen, grads = {}, {}

    def keep(name, tensor):
        seen[name] = tensor

        def hook(grad):
            grads[name] = grad.numpy()
        tensor.register_hook(hook)

    mlp.gate_proj.register_forward_post_hook(lambda layer, inputs, out: keep("gate", out))
    mlp.up_proj.register_forward_post_hook(lambda layer, inputs, out: keep("up", out))
    mlp.down_proj.register_forward_pre_hook(lambda layer, inputs: keep("act", inputs[0]))
    out = run_phases(request, phases, guard, "paddleformers DeepseekV3MLP", lambda: mlp(x),
               lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    outputs = {"intermediate.fc1_out": np.concatenate([seen["gate"][0].numpy(), seen["up"][0].numpy()], axis=-1),
               "intermediate.act_out": seen["act"][0].numpy(), "out": out[0].numpy(),
               "grad.fc2_weight": transposed(mlp.down_proj.weight.grad.numpy()),
               "intermediate.grad_act_out": grads["act"][0],
               "intermediate.grad_fc1_out": np.concatenate([grads["gate"][0], grads["up"][0]], axis=-1),
               "grad.fc1_weight": _fc1_grad(mlp), "grad.input": x.grad[0].numpy()}
    return outputs, _name("paddleformers DeepseekV3MLP (shared expert, fuse_up_gate=False): gate_proj, up_proj "
                          f"(nn.Linear), {type(mlp.act_fn).__name__}(gate) * up, down_proj", request)


def routed_experts(request, tensors, gate, phases, guard):
    """``DeepseekV3MoE.moe`` (the non-EP path, ``fd_fallback`` off) over its own experts (``DeepseekV3MLP``,
    fuse_up_gate=False): per expert, the tokens routed to it (one_hot + where), gate/up/down GEMMs, times the routing
    weight *after* down_proj, index_add_ into an fp32 buffer, cast back. The op's tokens arrive grouped by expert
    (``ops.uneven_split``); they are passed as top-1 routing (topk_indices = each token's expert, weights = probs)."""
    _, modeling = _modules()
    h, f, e = (request["shapes"][n] for n in ("hidden_size", "ffn_hidden_size", "num_local_experts"))
    config = _config(request, **experts_fields(h, f, e))
    with _default_dtype(request["dtype"]):
        moe = modeling.DeepseekV3MoE(config)
    for i, expert in enumerate(moe.experts):
        _load_mlp(expert, tensors["fc1_weight"][i], tensors["fc2_weight"][i], f)
    counts = ops.uneven_split(tensors["input"].shape[0], e)
    owner = paddle.to_tensor(np.repeat(np.arange(e), counts).astype(np.int64)[:, None])
    x, probs = as_tensor(tensors["input"]), as_tensor(tensors["probs"])
    out = run_phases(request, phases, guard, "paddleformers DeepseekV3MoE.moe",
               lambda: moe.moe(x, owner, probs.unsqueeze(-1)),
               lambda o: o.backward(_grad(tensors, "grad_output")))
    return ({"out": out.numpy(),
             "grad.fc2_weight": np.stack([transposed(m.down_proj.weight.grad.numpy()) for m in moe.experts]),
             "grad.probs": probs.grad.numpy(), "grad.fc1_weight": np.stack([_fc1_grad(m) for m in moe.experts]),
             "grad.input": x.grad.numpy()},
            _name(f"paddleformers DeepseekV3MoE.moe over DeepseekV3MLP experts (routing weight applied after "
                  f"down_proj, fp32 index_add_), tokens per expert {counts}", request))


def linear(request, tensors, gate, phases, guard):
    """``paddleformers.nn.linear.Linear.create(..., tp_plan="colwise" | "rowwise")``: a ``paddle.nn.Linear`` at TP=1
    (F.linear on the [in, out] weight), as the model's projections are built."""
    if request["config"].get(ops.REFEED_STAGE) == "shared_expert_mlp.fc1":
        return _shared_expert_fc1(request, tensors, phases, guard)
    _, modeling = _modules()
    n_in, n_out = request["shapes"]["input_size"], request["shapes"]["output_size"]
    bias = request["config"].get("bias", False)
    plan = "colwise" if request["op"] == "column_parallel_linear" else "rowwise"
    config = _config(request, hidden_size=n_in)
    with _default_dtype(request["dtype"]):
        layer = modeling.GeneralLinear.create(n_in, n_out, has_bias=bias, config=config, tp_plan=plan)
    set_param(layer.weight, transposed(tensors["weight"]))
    if bias:
        set_param(layer.bias, tensors["bias"])
    x = as_tensor(tensors["input"][None])
    out = run_phases(request, phases, guard, f"paddleformers Linear ({plan})", lambda: layer(x),
               lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    outputs = {"out": out[0].numpy(), "grad.input": x.grad[0].numpy(),
               "grad.weight": transposed(layer.weight.grad.numpy())}
    if bias:
        outputs["grad.bias"] = layer.bias.grad.numpy()
    return outputs, _name(f"paddleformers.nn.linear.Linear.create(tp_plan={plan!r}) -> paddle.nn.Linear", request)


def _shared_expert_fc1(request, tensors, phases, guard):
    """Re-feed's fc1 stage of ``shared_expert_mlp`` as that block runs here: ``DeepseekV3MLP``'s gate_proj and
    up_proj, two GEMMs on one input (outputs and weight grads concatenated, the input grad their dgrads' sum)."""
    h, f = request["shapes"]["input_size"], request["shapes"]["output_size"] // 2
    mlp = _mlp(request, h, f)
    _load_mlp(mlp, tensors["weight"], np.zeros((h, f), tensors["weight"].dtype), f)
    x = as_tensor(tensors["input"][None])
    out = run_phases(request, phases, guard, "paddleformers DeepseekV3MLP gate_proj + up_proj",
                     lambda: paddle.concat([mlp.gate_proj(x), mlp.up_proj(x)], axis=-1),
                     lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    return ({"out": out[0].numpy(), "grad.input": x.grad[0].numpy(), "grad.weight": _fc1_grad(mlp)},
            _name("paddleformers DeepseekV3MLP (fuse_up_gate=False) gate_proj and up_proj (nn.Linear): the shared "
                  "expert block's fc1, re-fed", request))


def mla_up_projection(request, tensors, gate, phases, guard):
    """``DeepseekV3Attention.q_b_proj`` / ``kv_b_proj``: ``Linear.create(lora_rank, heads * head_dim,
    has_bias=False, tp_plan="colwise")`` (a paddle.nn.Linear at TP=1), then ``reshape([0, 0, heads, head_dim])``."""
    _, modeling = _modules()
    rank, heads, dim = (request["shapes"][n] for n in ("lora_rank", "num_heads", "head_dim"))
    config = _config(request, hidden_size=rank)
    with _default_dtype(request["dtype"]):
        layer = modeling.GeneralLinear.create(rank, heads * dim, has_bias=False, config=config, tp_plan="colwise",
                                              gather_output=False)
    set_param(layer.weight, transposed(tensors["weight"]))
    x = as_tensor(tensors["input"][None])
    out = run_phases(request, phases, guard, "paddleformers q_b/kv_b projection",
               lambda: layer(x).reshape([0, 0, heads, dim]),
               lambda o: o.backward(_grad(tensors, "grad_output")[None]))
    return ({"out": out[0].numpy(), "grad.input": x.grad[0].numpy(),
             "grad.weight": transposed(layer.weight.grad.numpy())},
            _name("DeepseekV3Attention q_b_proj / kv_b_proj: Linear.create(colwise) -> paddle.nn.Linear, "
                  "reshape([0, 0, heads, head_dim])", request))


IMPLEMENTATIONS = {
    ops.COLUMN_PARALLEL_LINEAR: linear, ops.ROW_PARALLEL_LINEAR: linear, ops.RMS_NORM: rms_norm, ops.SWIGLU: swiglu,
    ops.EMBEDDING: embedding, ops.MOE_ROUTER: moe_router, ops.ATTENTION_SCORES: attention_scores,
    ops.SHARED_EXPERT_MLP: shared_expert_mlp, ops.ROUTED_EXPERTS: routed_experts,
    ops.MLA_UP_PROJECTION: mla_up_projection,
}
