"""The reference recipe, the Paddle side's lowest level (``IMPLEMENTATIONS``, keyed by the op record): plain Paddle
ops that compute what PaddleFleet's code computes, with the accuracy gate on and off; not PaddleFleet's module (that
level is ``fleet.py``, PaddleFormers' is ``formers.py``; ``levels.py`` picks).

Each op follows the PaddleFleet file and commit ``SOURCES`` names (PaddlePaddle/PaddleFleet, read with the project's
search tool; the runner writes it to meta.json as ``paddle_source``), or, where it follows something PaddleFleet's
code does not contain, says that instead (RMSNorm: the seed PR's FP32 island). docs/paddle-levels.md says how and
where each was checked against PaddleFleet's own code. The seed PR's FP32-island SwiGLU, which PaddleFleet's code
no longer has, is its own level (``islands.py``).
On a CPU many bf16 kernels are not registered (matmul, silu, sigmoid, swiglu, rms_norm); the caller's kernel guard
turns that into UNSUPPORTED naming the kernel, except silu and sigmoid, computed in fp32 and rounded once (what
Paddle's CUDA kernels do with a bf16 input). Each function takes (request, tensors, gate, phases, guard) and returns
(outputs as numpy, implementation); outputs are in canonical names and Megatron's layout.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F

from harness.case import ops
from harness.run.protocol import Unsupported
from harness.runners.paddle.common import as_tensor, run_phases, sync, transposed

# The PaddleFleet code each recipe follows (PaddlePaddle/PaddleFleet, file@commit, read with the project's search
# tool at these commits): SOURCES says which op follows which.
FLEET_ROUTER = "src/paddlefleet/transformer/moe/moe_router.py@01ae3ccf6d11a45944a64f77baa4cf1eb60a486e"
FLEET_MLP = "src/paddlefleet/transformer/mlp.py@9f9bd7b9952d3cbfdd48f80138cf4d794c753979"
FLEET_SWIGLU = "src/paddlefleet/fusions/fused_bias_swiglu.py@d522e07b5b81991b306b74cac0ba232a21c69d52"
FLEET_NORM = "src/paddlefleet/transformer/paddle_norm.py@0534a45160925fcef9a133986ce3655f04cc997e"
FLEET_EXPERTS = "src/paddlefleet/transformer/moe/fp8_utils.py@08efc32772b47402a0cddcd14ea28d8e23c2a0b4"
FLEET_SOFTMAX = "src/paddlefleet/fusions/fused_softmax.py@3ca20b50f66310b722b2b507d54830b82da1c950"
FLEET_EMBEDDING = "src/paddlefleet/tensor_parallel/layers.py@021152f8ba60d370b43f7e110fdbabe75e873b13"
FLEET_LINEAR = "src/paddlefleet/tensor_parallel/layers.py@023ee66c6bd20101d946d14fef24588df4d515ac"
FLEET_MLA = "src/paddlefleet/transformer/multi_latent_attention.py@023ee66c6bd20101d946d14fef24588df4d515ac"
FLEET_YARN = ("src/paddlefleet/models/common/embeddings/yarn_rotary_pos_embedding.py"
              "@2bb472d25dbbb6692b29a0ac078a6c16d4c3b7c1")
FLEET_ROPE = "src/paddlefleet/models/common/embeddings/rope_utils.py@0341e9a6e420416138bfe624038e2239ce2cb51b"
FLEET_ATTENTION = "src/paddlefleet/transformer/dot_product_attention.py@00a9f175a76aa0dc93c445746a3c90efa5566069"
FLEET_MOE_LAYER = "src/paddlefleet/transformer/moe/moe_layer.py@0059136f0036f4278a0e45f48951d2b7c6c6e203"
FLEET_MOE_UTILS = "src/paddlefleet/transformer/moe/moe_utils.py@01bc6d25b5b1d0e6315f53817f3b72207947e932"
FLEET_LM_HEAD = "src/paddlefleet/models/gpt/lm_head.py@04cb7f3de0b5ef5cb811bf832c3146d1196a221f"
FLEET_LOSS = "src/paddlefleet/models/common/language_loss/language_loss.py@00c72d67cc08c97ac2fb9f806120c71d14018216"
SEED_ISLANDS = ("the seed PR's first revision (its description: \"the gate gives FP32 islands (RMSNorm, SwiGLU with "
                "per-token scale, softmax)\"), not PaddleFleet's code")


def linear(request, tensors, gate, phases, guard):
    """Column- or row-parallel linear: a static oneDNN graph for bf16 on a CPU (dygraph has no CPU bf16 matmul),
    dygraph otherwise (PaddleFleet's own module is the level above: harness/runners/paddle/fleet.py)."""
    if request["device"] == "cpu" and request["dtype"] == "bfloat16":
        return _static_onednn_linear(request, tensors, gate, phases, guard)
    return _dygraph_linear(request, tensors, gate, phases, guard)


def _dygraph_linear(request, tensors, gate, phases, guard):
    x, w, b = _feeds(tensors, request)
    x, w = paddle.to_tensor(x), paddle.to_tensor(w)
    bias = paddle.to_tensor(b) if b is not None else None
    for t in (x, w, bias):
        if t is not None:
            t.stop_gradient = False
    linear, name = _linear_function(gate, request)
    with phases("forward"):
        out = guard(lambda: linear(x, w, bias), name, request)
        sync(request)
    with phases("backward"):
        guard(lambda: out.backward(paddle.to_tensor(tensors["grad_output"])), name + " backward", request)
        sync(request)
    results = [out.numpy(), x.grad.numpy(), w.grad.numpy()] + ([bias.grad.numpy()] if bias is not None else [])
    return _canonical(results), f"paddle dygraph {name} (plain Paddle ops following the gated path)"


def _static_onednn_linear(request, tensors, gate, phases, guard):
    """The same ops in a static Program, run by oneDNN: Paddle's only CPU bf16 GEMM."""
    x, w, b = _feeds(tensors, request)
    paddle.enable_static()
    paddle.set_flags({"FLAGS_use_onednn": True})
    main, startup = paddle.static.Program(), paddle.static.Program()
    linear, name = _linear_function(gate, request)
    with paddle.static.program_guard(main, startup):
        xs = paddle.static.data("x", list(x.shape), "bfloat16")
        ws = paddle.static.data("w", list(w.shape), "bfloat16")
        dys = paddle.static.data("dy", list(tensors["grad_output"].shape), "bfloat16")
        bs = paddle.static.data("b", list(b.shape), "bfloat16") if b is not None else None
        wrt = [v for v in (xs, ws, bs) if v is not None]
        for v in wrt:
            v.stop_gradient = False
        out = linear(xs, ws, bs)
        grads = paddle.static.gradients([out], wrt, target_gradients=[dys])
    feed = {"x": x, "w": w, "dy": tensors["grad_output"], **({"b": b} if b is not None else {})}
    executor = paddle.static.Executor(paddle.CPUPlace())
    with phases("forward+backward"):
        results = guard(lambda: executor.run(main, feed=feed, fetch_list=[out, *grads]),
                                f"oneDNN bf16 {name} (static graph)", request)
    paddle.disable_static()
    return _canonical(results), f"paddle static graph + oneDNN, {name} (plain Paddle ops following the gated path)"


def _linear_function(gate, request):
    """The gated path calls F.linear; with the gate off PaddleFleet uses fused_linear (a GPU kernel)."""
    if gate:
        return (lambda x, w, b: paddle.nn.functional.linear(x, w, b)), "paddle.nn.functional.linear"
    if request["device"] != "gpu":
        raise Unsupported("use_accuracy_compatible=False takes PaddleFleet's fused_linear, which has no CPU kernel")
    from paddle.incubate.nn.functional import fused_linear

    return (lambda x, w, b: fused_linear(x, w, b)), "paddle.incubate.nn.functional.fused_linear"


def _feeds(tensors, request):
    """Inputs in Paddle's layout: the weight becomes [in, out] (a transpose: exact)."""
    weight = transposed(tensors["weight"])
    return tensors["input"], weight, tensors.get("bias")


def _canonical(results):
    """Back to canonical names and layout: Paddle's weight grad is [in, out], Megatron's [out, in]."""
    names = ["out", "grad.input", "grad.weight", "grad.bias"]
    outputs = {name: np.asarray(r) for name, r in zip(names, results, strict=False)}
    outputs["grad.weight"] = transposed(outputs["grad.weight"])
    return outputs


def _rms_norm_island(x, weight, eps):
    x32 = x.astype("float32")
    normed = x32 * paddle.rsqrt(x32.pow(2).mean(axis=-1, keepdim=True) + eps)
    return (normed * weight.astype("float32")).astype(x.dtype)


def rms_norm(request, tensors, gate, phases, guard):
    """Gate on: the seed PR's FP32 island (PaddleFleet's RMSNorm has no gated branch: SOURCES). Gate off: PaddleFleet's
    ``RMSNorm.forward``, ``fused_rms_norm_ext`` cast to the weight's dtype (GPU only)."""
    eps = request["config"]["eps"]
    x, w = as_tensor(tensors["input"]), as_tensor(tensors["weight"])
    if gate:
        def forward():
            return _rms_norm_island(x, w, eps)
        kernel, name = "FP32-island RMSNorm", "FP32 island: cast fp32, x * rsqrt(mean(x^2) + eps) * w, cast back"
    else:
        from paddle.incubate.nn.functional.fused_rms_norm_ext import fused_rms_norm_ext

        def forward():
            return fused_rms_norm_ext(x, w, eps)[0].astype(w.dtype)
        kernel = name = "paddle.incubate.nn.functional.fused_rms_norm_ext"
    out = run_phases(request, phases, guard, kernel, forward,
                     lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    return ({"out": out.numpy(), "grad.input": x.grad.numpy(), "grad.weight": w.grad.numpy()},
            f"paddle dygraph {name} (use_accuracy_compatible={gate})")


def in_dtype(function, x):
    """``function`` (F.silu or F.sigmoid) of x in x's dtype. Paddle's CPU build registers neither in bf16: there it
    is computed in fp32 and rounded once, as Paddle's CUDA kernels compute it for a bf16 input (CudaSiluFunctor,
    CudaSigmoidFunctor: float math, one rounding; paddle/phi/kernels/funcs/activation_functor.h)."""
    if x.dtype == paddle.bfloat16 and not x.place.is_gpu_place():
        return function(x.astype("float32")).astype(x.dtype)
    return function(x)


def _swiglu_eager(y):
    """``swiglu_eager`` (FLEET_SWIGLU): silu(gate) * up in y's dtype (two roundings in bf16)."""
    gate_half, up = paddle.chunk(y, 2, axis=-1)
    return in_dtype(F.silu, gate_half) * up


def _swiglu_back_eager(g, y):
    """``swiglu_back_eager`` (FLEET_SWIGLU): the hand-written SwiGLU backward, term by term in the operands' dtypes."""
    gate_half, up = paddle.chunk(y, 2, axis=-1)
    sigmoid = in_dtype(F.sigmoid, gate_half)
    return paddle.concat((g * sigmoid * (1 + gate_half * (1 - sigmoid)) * up, g * in_dtype(F.silu, gate_half)),
                         axis=-1)


class _SwiGLU(paddle.autograd.PyLayer):
    """``SwiGLUFunction`` with ``use_accuracy_compatible`` (FLEET_SWIGLU): swiglu_eager, hand-written backward."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return _swiglu_eager(y)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensor()
        return _swiglu_back_eager(grad, y)


class _WeightedSwiGLU(paddle.autograd.PyLayer):
    """``WeightedSwiGLUFunction`` with ``use_accuracy_compatible`` (FLEET_SWIGLU): (swiglu_eager(y) * weights) cast
    to y's dtype (fp32 weights promote the product); backward ``weighted_swiglu_back_eager``."""

    @staticmethod
    def forward(ctx, y, weights):
        ctx.save_for_backward(y, weights)
        return (_swiglu_eager(y) * weights).astype(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensor()
        grad_input = _swiglu_back_eager(grad * weights, y)
        grad_weights = (_swiglu_eager(y) * grad.astype(weights.dtype)).sum(axis=-1, keepdim=True)
        return grad_input.astype(y.dtype), grad_weights.astype(weights.dtype)


def gated_swiglu(y, scale):
    """The SwiGLU ``MLP.forward`` (FLEET_MLP) runs under the gate with bias_activation_fusion:
    ``bias_swiglu_impl`` without a scale, ``weighted_bias_swiglu_impl(y, None, scale.unsqueeze(-1))`` with one."""
    return _SwiGLU.apply(y) if scale is None else _WeightedSwiGLU.apply(y, scale.unsqueeze(-1))


GATED_SWIGLU = "PaddleFleet's gated SwiGLU: silu(gate) * up in the input dtype, hand-written backward"


def swiglu(request, tensors, gate, phases, guard):
    """Gate on: ``gated_swiglu``. Gate off: Paddle's fused ``F.swiglu`` (GPU only), the scale in fp32 under autograd
    (not PaddleFleet's hand-written ``weighted_swiglu_back``: SOURCES)."""
    x = as_tensor(tensors["input"])
    scale = as_tensor(tensors["per_token_scale"]) if "per_token_scale" in tensors else None
    if gate:
        def forward():
            return gated_swiglu(x, scale)
        kernel = "gated SwiGLU"
        name = GATED_SWIGLU + (", * scale in fp32, cast once" if scale is not None else "")
    else:
        def forward():
            out = F.swiglu(x)
            return out if scale is None else (out.astype("float32") * scale.unsqueeze(-1)).astype(x.dtype)
        kernel = name = "paddle.nn.functional.swiglu" + (" then * scale in fp32" if scale is not None else "")
    out = run_phases(request, phases, guard, kernel, forward,
                     lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    outputs = {"out": out.numpy(), "grad.input": x.grad.numpy()}
    if scale is not None:
        outputs["grad.per_token_scale"] = scale.grad.numpy()
    return outputs, f"paddle dygraph {name} (use_accuracy_compatible={gate})"


def embedding(request, tensors, gate, phases, guard):
    """``VocabParallelEmbedding.forward`` at TP=1 (FLEET_EMBEDDING): ``weight[ids]`` under the gate, else
    ``F.embedding``."""
    ids, w = as_tensor(tensors["ids"], False), as_tensor(tensors["weight"])
    if gate:
        def forward():
            return w[ids]
        kernel = "weight[ids] (gather)"
    else:
        def forward():
            return F.embedding(ids, w)
        kernel = "paddle.nn.functional.embedding"
    out = run_phases(request, phases, guard, kernel, forward,
                     lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    return ({"out": out.numpy(), "grad.weight": w.grad.numpy()},
            f"paddle dygraph {kernel} (use_accuracy_compatible={gate})")


def shared_expert_mlp(request, tensors, gate, phases, guard, activation=None):
    """``MLP.forward`` at TP=1 (FLEET_MLP): fc1 (F.linear) -> SwiGLU -> fc2 (F.linear) on Paddle's [in, out] weights,
    the SwiGLU ``gated_swiglu`` under the gate (``activation``, with its name, replaces it: the FP32-island level);
    intermediates and their grads captured with tensor hooks. Dygraph only: on a CPU its bf16 matmul kernel is not
    registered."""
    x = as_tensor(tensors["input"])
    w1 = as_tensor(transposed(tensors["fc1_weight"]))  # Paddle's [in, out]
    w2 = as_tensor(transposed(tensors["fc2_weight"]))
    if not gate:
        raise_if_cpu_gate_off(request)
    act, act_name = activation or ((lambda y: gated_swiglu(y, None)) if gate else F.swiglu,
                                   GATED_SWIGLU if gate else "paddle.nn.functional.swiglu")
    captured = {}

    def keep(name):
        def hook(grad):
            captured[name] = grad.numpy()
        return hook

    def forward():
        fc1_out = F.linear(x, w1)
        act_out = act(fc1_out)
        captured["intermediate.fc1_out"], captured["intermediate.act_out"] = fc1_out.numpy(), act_out.numpy()
        fc1_out.register_hook(keep("intermediate.grad_fc1_out"))
        act_out.register_hook(keep("intermediate.grad_act_out"))
        return F.linear(act_out, w2)

    out = run_phases(request, phases, guard, f"F.linear -> {act_name} -> F.linear", forward,
                     lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    outputs = {**captured, "out": out.numpy(), "grad.input": x.grad.numpy(),
               "grad.fc1_weight": transposed(w1.grad.numpy()),
               "grad.fc2_weight": transposed(w2.grad.numpy())}
    return outputs, f"paddle dygraph F.linear -> {act_name} -> F.linear (use_accuracy_compatible={gate})"


class _GateMatmul(paddle.autograd.PyLayer):
    """``FusedGateDetachMatmul`` with ``use_accuracy_compatible`` (FLEET_ROUTER): the logits F.linear in fp32; the
    backward as two GEMMs, each grad cast to its tensor's dtype (x_grad = dy @ w, w_grad = dy^T @ x)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x.astype("float32"), w.T.astype("float32"))

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensor()
        x_grad = paddle.matmul(grad, w.astype("float32")).astype(x.dtype)
        w_grad = paddle.matmul(grad, x.astype("float32"), transpose_x=True).astype(w.dtype)
        return x_grad, w_grad


def moe_router(request, tensors, gate, phases, guard):
    """``TopKRouter.forward`` under the gate (FLEET_ROUTER; noaux_tc, one group, sigmoid, norm_topk_prob, no aux or
    z loss): ``FusedGateDetachMatmul``, sigmoid, top-k of scores + expert bias, the chosen scores by ``gather_nd``,
    normalised by their sum taken in float64 and cast to float32 (+1e-20), times the scaling factor, scattered into
    the dense probs. The gate-off router (fused gating) is not written."""
    if not gate:
        raise Unsupported("the gate-off router (PaddleFleet's fused gating GEMM) is not implemented in this runner")
    k = request["shapes"]["topk"]
    scaling = request["config"]["topk_scaling_factor"]
    x, w = as_tensor(tensors["input"]), as_tensor(tensors["weight"])
    bias = as_tensor(tensors["expert_bias"], False)

    def forward():
        scores = F.sigmoid(_GateMatmul.apply(x, w).astype("float32"))
        _, chosen = paddle.topk(scores + bias.unsqueeze(0), k, axis=-1, sorted=True)
        rows = paddle.arange(scores.shape[0], dtype=chosen.dtype).unsqueeze(-1).expand(chosen.shape)
        picked = paddle.gather_nd(scores, paddle.stack([rows, chosen], axis=-1))
        denominator = picked.astype("float64").sum(axis=-1, keepdim=True).astype("float32") + 1e-20
        probs = picked / denominator * scaling
        return paddle.zeros_like(scores, dtype=probs.dtype).put_along_axis_(chosen, probs, axis=1), chosen

    probs, chosen = run_phases(request, phases, guard, "fp32 router (matmul, sigmoid, topk)", forward,
                               lambda o: o[0].backward(as_tensor(tensors["grad_probs"], False)))
    return ({"topk_indices": np.sort(chosen.numpy().astype(np.int64), axis=-1), "probs": probs.numpy(),
             "grad.input": x.grad.numpy(), "grad.weight": w.grad.numpy()},
            "paddle dygraph, PaddleFleet's gated TopKRouter: fp32 gating GEMM (two-GEMM backward), sigmoid, topk on "
            f"scores + expert_bias, gather_nd, normalise by a float64 sum, x{scaling} (use_accuracy_compatible={gate})")


def attention_scores(request, tensors, gate, phases, guard):
    """``DotProductAttention``'s unfused core (FLEET_ATTENTION: ``baddbmm(beta=0, alpha=1/sqrt(d))``), then
    ``FusedScaleMaskSoftmax``'s unfused path (FLEET_SOFTMAX): causal mask filled with -10000, softmax in fp32, cast
    back to the input dtype. Gate off: paddle's softmax in the input dtype."""
    d = request["shapes"]["head_dim"]
    q, k = as_tensor(tensors["query"]), as_tensor(tensors["key"])
    n, t = tensors["query"].shape[1], tensors["query"].shape[0]
    mask = paddle.to_tensor(np.triu(np.ones((t, t), dtype=bool), 1))
    captured = {}

    def forward():
        buffer = paddle.empty([n, t, t], dtype=q.dtype)
        scores = paddle.baddbmm(buffer, q.transpose([1, 0, 2]), k.transpose([1, 2, 0]), beta=0.0, alpha=1.0 / d ** 0.5)
        captured["intermediate.scores"] = scores.numpy()
        if gate:
            masked = paddle.where(mask, paddle.full_like(scores, -10000.0, "float32"), scores.astype("float32"))
            return F.softmax(masked, axis=-1).astype(scores.dtype)
        return F.softmax(paddle.where(mask, paddle.full_like(scores, -10000.0), scores), axis=-1)

    name = "baddbmm(alpha = 1/sqrt(d)), where(causal, -10000), " + ("FP32 softmax cast back" if gate else "softmax")
    out = run_phases(request, phases, guard, name, forward, lambda o: o.backward(as_tensor(tensors["grad_output"],
                     False)))
    return ({**captured, "out": out.numpy(), "grad.query": q.grad.numpy(), "grad.key": k.grad.numpy()},
            f"paddle dygraph {name} (use_accuracy_compatible={gate})")


class _ExpertSwiGLUProb(paddle.autograd.PyLayer):
    """SwiGLU times the routing probability as PaddleFleet's MoE expert node runs it under the gate (FLEET_EXPERTS,
    ``fwd_down_bf16`` / ``bwd_down_input_bf16``): silu(gate) * up * prob in fp32, rounded once; backward: the gate
    and up grads by autograd over the same fp32 expression, the probability's grad summed in float64."""

    @staticmethod
    def forward(ctx, o1, probs):
        ctx.save_for_backward(o1, probs)
        gate_half, up = paddle.chunk(o1, 2, axis=-1)
        return (F.silu(gate_half.astype("float32")) * up.astype("float32")
                * probs.unsqueeze(-1).astype("float32")).astype(o1.dtype)

    @staticmethod
    def backward(ctx, grad):
        o1, probs = ctx.saved_tensor()
        gate_half, up = paddle.chunk(o1, 2, axis=-1)
        with paddle.enable_grad():
            gate32, up32 = gate_half.astype("float32").detach(), up.astype("float32").detach()
            scale32 = probs.unsqueeze(-1).astype("float32").detach()
            for t in (gate32, up32, scale32):
                t.stop_gradient = False
            paddle.autograd.backward([F.silu(gate32) * up32 * scale32], [grad.astype("float32").detach()])
        grad_probs = (F.silu(gate32.detach().astype("float64")) * up32.detach().astype("float64")
                      * grad.astype("float64")).sum(axis=-1, keepdim=True)
        return (paddle.concat([gate32.grad, up32.grad], axis=-1).astype(o1.dtype),
                grad_probs.reshape(probs.shape).astype("float32").astype(probs.dtype))


def expert_swiglu_prob(o1, probs):
    return _ExpertSwiGLUProb.apply(o1, probs)


class _ExpertLinear(paddle.autograd.PyLayer):
    """One expert's GEMM as the expert node runs it (FLEET_EXPERTS): F.linear forward; the input grad as
    ``matmul(dy, w.T.contiguous())`` (``bwd_down_input_bf16``, ``bwd_gate_up_input_bf16``: a materialised transpose),
    the weight grad as autograd's (x^T @ dy)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensor()
        return paddle.matmul(grad, w.T.contiguous()), paddle.matmul(x, grad, transpose_x=True)


def routed_experts(request, tensors, gate, phases, guard, activation=None):
    """Per-expert GEMMs (PaddleFleet's gated expert node, FLEET_EXPERTS, with split per-expert GEMMs instead of the
    grouped kernel): split the permuted tokens by expert, ``_ExpertLinear`` -> ``expert_swiglu_prob`` ->
    ``_ExpertLinear``, concatenate; ``activation`` (with its name) replaces the SwiGLU x prob. Gate off (the
    grouped/fused expert GEMM) is not written here."""
    from harness.case.ops import uneven_split
    if not gate:
        raise Unsupported("the gate-off routed experts (PaddleFleet's grouped expert GEMM) are not implemented here")
    act, act_name = activation or (expert_swiglu_prob, "SwiGLU * prob in fp32 (prob grad summed in fp64)")
    experts = request["shapes"]["num_local_experts"]
    x, probs = as_tensor(tensors["input"]), as_tensor(tensors["probs"])
    w1 = [as_tensor(transposed(tensors["fc1_weight"][i])) for i in range(experts)]
    w2 = [as_tensor(transposed(tensors["fc2_weight"][i])) for i in range(experts)]
    counts = uneven_split(tensors["input"].shape[0], experts)

    def forward():
        outs = []
        for i, (tokens, scale) in enumerate(zip(paddle.split(x, counts), paddle.split(probs, counts), strict=True)):
            outs.append(_ExpertLinear.apply(act(_ExpertLinear.apply(tokens, w1[i]), scale), w2[i]))
        return paddle.concat(outs, axis=0)

    out = run_phases(request, phases, guard, "per-expert F.linear", forward,
                     lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    return ({"out": out.numpy(), "grad.input": x.grad.numpy(), "grad.probs": probs.grad.numpy(),
             "grad.fc1_weight": np.stack([transposed(w.grad.numpy()) for w in w1]),
             "grad.fc2_weight": np.stack([transposed(w.grad.numpy()) for w in w2])},
            f"paddle dygraph per-expert F.linear (input grad on the materialised transpose) -> {act_name} -> "
            f"F.linear, tokens per expert {counts} "
            f"(use_accuracy_compatible={gate})")


def raise_if_cpu_gate_off(request):
    """Gate off, PaddleFleet's linears take fused_linear: a GPU kernel (as in the linear cases)."""
    if request["device"] != "gpu":
        raise Unsupported("use_accuracy_compatible=False takes PaddleFleet's fused_linear, which has no CPU kernel")


def mla_up_projection(request, tensors, gate, phases, guard):
    """MLA's q/kv up-projection: PaddleFleet builds ``q_up_proj`` / ``kv_up_proj`` as its column-parallel linear and
    views the output as [tokens, heads, head_dim] (src/paddlefleet/transformer/multi_latent_attention.py,
    ``get_query_key_value_tensors``, PaddlePaddle/PaddleFleet@023ee66c6bd20101d946d14fef24588df4d515ac): the same
    linear path as the linear ops, then the view."""
    shapes, dy = request["shapes"], tensors["grad_output"]
    as_linear = {**request, "shapes": {"input_size": shapes["lora_rank"],
                                       "output_size": shapes["num_heads"] * shapes["head_dim"]},
                 "config": {**request["config"], "bias": False, "sequence_parallel": False}}
    outputs, implementation = linear(as_linear, {**tensors, "grad_output": dy.reshape(dy.shape[0], -1)}, gate,
                                     phases, guard)
    outputs["out"] = outputs["out"].reshape(dy.shape)
    return outputs, implementation + ", output viewed as [tokens, heads, head_dim]"


def _yarn_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_table(config, dim, tokens):
    """PaddleFleet's ``YarnRotaryEmbedding.forward`` (FLEET_YARN): inv_freq blended between extrapolation and
    interpolation by the linear ramp over [low, high], angles = outer(positions, inv_freq), duplicated; fp32."""
    base, factor = config["rotary_base"], config["rotary_scaling_factor"]
    inv_freq_extra = 1.0 / (base ** (paddle.arange(0, dim, 2).astype(paddle.float32) / dim))
    inv_freq_inter = 1.0 / (factor * base ** (paddle.arange(0, dim, 2).astype(paddle.float32) / dim))

    def correction_dim(rotations):
        return (dim * math.log(config["original_max_position_embeddings"] / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(config["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(config["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = paddle.clip((paddle.arange(dim // 2).astype(paddle.float32) - low) / (high - low), 0, 1)
    inv_freq_mask = 1.0 - ramp.astype(paddle.float32)
    inv_freq = inv_freq_inter * (1 - inv_freq_mask) + inv_freq_extra * inv_freq_mask
    seq = paddle.arange(tokens).astype(inv_freq_extra.dtype) + 0
    freqs = paddle.outer(seq, inv_freq)
    mscale = float(_yarn_mscale(factor, config["mscale"]) / _yarn_mscale(factor, config["mscale_all_dim"]))
    return paddle.concat((freqs, freqs), axis=-1), mscale


def _rotate(t, freqs, mscale):
    """PaddleFleet's ``_apply_rotary_pos_emb_bshd`` (FLEET_ROPE), unfused, MLA de-interleave, not high precision."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = paddle.concat((t[..., 0::2], t[..., 1::2]), axis=-1)
    cos_ = (paddle.cos(freqs) * mscale).astype(t.dtype)
    sin_ = (paddle.sin(freqs) * mscale).astype(t.dtype)
    x1, x2 = paddle.chunk(t, 2, axis=-1)
    rotated = paddle.concat((-x2, x1), axis=-1)
    t = (t * cos_) + (rotated * sin_)
    return paddle.concat((t, t_pass), axis=-1)


def yarn_rope(request, tensors, gate, phases, guard):
    """MLA's rope path as PaddleFleet's ``MLASelfAttention.get_query_key_value_tensors`` runs it without rope fusion
    (FLEET_MLA): the YaRN table from ``YarnRotaryEmbedding`` (FLEET_YARN), ``apply_rotary_pos_emb`` on q_pe
    [tokens, heads, 64] and on k_pe [tokens, 1, 64] (FLEET_ROPE: cos/sin in fp32 times mscale, cast to the input
    dtype, t * cos + rotate_half(t) * sin in the input dtype), then k_pe expanded to every head. The gate does not
    change this path (``high_precision_rope`` is a separate option, off)."""
    n, d = request["shapes"]["num_heads"], request["shapes"]["rope_dim"]
    q, k = as_tensor(tensors["query"]), as_tensor(tensors["key"])
    t = tensors["query"].shape[0]
    captured = {}

    def forward():
        freqs, mscale = _yarn_table(request["config"], d, t)
        captured["intermediate.freqs"], captured["mscale"] = freqs.numpy(), mscale
        freqs = freqs.unsqueeze(1)  # [s, 1, 64]
        q_out = _rotate(q, freqs, mscale)
        k_out = _rotate(k.unsqueeze(-2), freqs, mscale)
        captured["out.key"] = k_out.reshape([t, d]).numpy()
        return q_out, k_out.expand([-1, n, -1])

    def backward(outs):
        grads = [as_tensor(tensors["grad_query"], False), as_tensor(tensors["grad_key"], False)]
        paddle.autograd.backward(list(outs), grads)

    q_out, _ = run_phases(request, phases, guard, "YaRN rope (cos/sin fp32, rotate in the input dtype)", forward,
                          backward)
    # YarnRotaryEmbedding._set_cos_sin_cache / get_cached_cos_sin: (emb.cos() * mscale).to(dtype), as the rotation uses
    freqs = paddle.to_tensor(captured["intermediate.freqs"])
    cos, sin = ((f(freqs) * captured["mscale"]).astype(q.dtype).numpy() for f in (paddle.cos, paddle.sin))
    return ({"intermediate.freqs": captured["intermediate.freqs"], "intermediate.cos": cos, "intermediate.sin": sin,
             "out.query": q_out.numpy(),
             "out.key": captured["out.key"], "grad.query": q.grad.numpy(), "grad.key": k.grad.numpy()},
            f"paddle dygraph, PaddleFleet's YarnRotaryEmbedding + _apply_rotary_pos_emb_bshd (MLA de-interleave, "
            f"mscale {captured['mscale']}), k_pe expanded to {n} heads (use_accuracy_compatible={gate})")


def core_attention(request, tensors, gate, phases, guard):
    """PaddleFleet's ``DotProductAttention`` explicit path (FLEET_ATTENTION; it takes it for fp32 inputs, its bf16
    branch calls scaled_dot_product_attention / flashmask): [b, s, n, d] -> baddbmm(beta 0, alpha = softmax
    scale), causal masked softmax in fp32 (masked_fill -10000, as Megatron's attention_mask_func) cast back, bmm with
    V, back to [b, s, n, dv]. The gate does not change this module at that commit."""
    scale = request["config"]["softmax_scale"]
    q, k, v = as_tensor(tensors["query"]), as_tensor(tensors["key"]), as_tensor(tensors["value"])
    t, n, dv = tensors["value"].shape
    mask = paddle.to_tensor(np.triu(np.ones((t, t), dtype=bool), 1))
    captured = {}

    def forward():
        query = q.unsqueeze(0).transpose([0, 2, 1, 3]).reshape([n, t, -1])
        key = k.unsqueeze(0).transpose([0, 2, 3, 1]).reshape([n, -1, t])
        scores = paddle.baddbmm(paddle.empty([n, t, t], q.dtype), query, key, beta=0.0, alpha=scale)
        masked = paddle.where(mask, paddle.full_like(scores, -10000.0, "float32"), scores.astype("float32"))
        probs = F.softmax(masked, axis=-1).astype(scores.dtype)
        captured["intermediate.probs"] = probs.numpy()

        def hook(grad):
            captured["intermediate.grad_probs"] = grad.numpy()
        probs.register_hook(hook)
        value = v.unsqueeze(0).transpose([0, 2, 1, 3]).reshape([n, t, -1])
        context = paddle.bmm(probs, value).reshape([1, n, t, dv]).transpose([0, 2, 1, 3])
        return context.reshape([t, n, dv])

    name = "baddbmm * scale, where(causal, -10000), FP32 softmax cast back, bmm"
    out = run_phases(request, phases, guard, name, forward, lambda o: o.backward(as_tensor(tensors["grad_output"],
                     False)))
    return ({**captured, "out": out.numpy(), "grad.value": v.grad.numpy(), "grad.query": q.grad.numpy(),
             "grad.key": k.grad.numpy()},
            f"paddle dygraph {name}, as PaddleFleet's DotProductAttention explicit path, alpha={scale!r} "
            f"(use_accuracy_compatible={gate})")


def moe_combine(request, tensors, gate, phases, guard):
    """PaddleFleet's MoE combine with expert parallelism (FLEET_MOE_LAYER ``custom_forward``: under the gate the
    routing probability is the experts' per_token_scale, so the combine gets weighted outputs): the permutation of
    ``moe_utils.permute`` (FLEET_MOE_UTILS: masked_select of token ids by the transposed routing map, expert-major),
    ``unpermute`` = zeros in the tokens' dtype then ``scatter_(index, updates, overwrite=False)``, then
    ``output + shared_output`` (``MoELayer.forward``)."""
    from harness.case.ops import combine_routing

    shapes = request["shapes"]
    t, experts = tensors["shared_output"].shape[0], shapes["num_experts"]
    routing = np.zeros((t, experts), dtype=bool)
    for token, chosen in enumerate(combine_routing(t, experts, shapes["topk"])):
        routing[token, chosen] = True
    routing_map = paddle.to_tensor(routing)
    sorted_indices = paddle.arange(t).unsqueeze(0).expand([experts, -1]).masked_select(routing_map.T.contiguous())
    routed, shared = as_tensor(tensors["expert_output"]), as_tensor(tensors["shared_output"])

    def forward():
        output = paddle.zeros(shared.shape, dtype=routed.dtype)
        output = paddle.scatter(output, sorted_indices, routed, overwrite=False)
        return output + shared

    out = run_phases(request, phases, guard, "scatter (overwrite=False) + add", forward,
               lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    return ({"out": out.numpy(), "grad.expert_output": routed.grad.numpy(), "grad.shared_output": shared.grad.numpy()},
            "paddle dygraph, PaddleFleet's moe_utils.unpermute (zeros, scatter overwrite=False in the tokens' dtype, "
            f"expert-major order) + shared expert output, as MoELayer (use_accuracy_compatible={gate})")


def lm_head_loss(request, tensors, gate, phases, guard):
    """PaddleFleet's ``GPTLMHead`` (FLEET_LM_HEAD: weight [vocab, hidden], forward through its column-parallel
    linear with ``weight.T``: F.linear under the gate) and ``LanguageLoss`` at TP=1 (FLEET_LOSS:
    ``CrossEntropyLoss(reduction="none")`` on ``logits.cast("float32")``, then sum(loss x lossmask) / lossmask.sum()).
    Dygraph only: on a CPU its bf16 matmul kernel is not registered."""
    if not gate:
        raise_if_cpu_gate_off(request)
    x, w = as_tensor(tensors["input"]), as_tensor(tensors["weight"])
    labels = as_tensor(tensors["labels"], False)
    captured = {}

    def forward():
        logits = F.linear(x, w.T)
        captured["intermediate.logits"] = logits.numpy()

        def hook(grad):
            captured["intermediate.grad_logits"] = grad.numpy()
        logits.register_hook(hook)
        token_loss = paddle.nn.CrossEntropyLoss(reduction="none")(logits.cast("float32"), labels)
        captured["out"] = token_loss.reshape([-1]).numpy()
        lossmask = (labels != -100).reshape([-1]).cast(paddle.float32)
        return paddle.sum(token_loss.cast(paddle.float32).reshape([-1]) * lossmask) / lossmask.sum()

    loss = run_phases(request, phases, guard, "F.linear -> CrossEntropyLoss(fp32)", forward, lambda o: o.backward())
    return ({**captured, "loss": loss.reshape([1]).numpy(), "grad.input": x.grad.numpy(),
             "grad.weight": w.grad.numpy()},
            "paddle dygraph F.linear(x, weight.T) -> CrossEntropyLoss(reduction='none') on fp32 logits, "
            f"sum(loss * mask) / mask.sum(), as GPTLMHead + LanguageLoss (use_accuracy_compatible={gate})")


def _linear_source(what):
    return (f"{what}: F.linear under the gate, as PaddleFleet's column/row-parallel linear calls it at TP=1 "
            f"({FLEET_LINEAR}; that commit is not stored where the project reads PaddleFleet's code), its grads by "
            "autograd; gate off: fused_linear (GPU only)")


# What each op's recipe follows (meta.json ``paddle_source``; docs/paddle-levels.md: how and where it was checked).
SOURCES = {
    ops.COLUMN_PARALLEL_LINEAR: _linear_source("ColumnParallelLinear"),
    ops.ROW_PARALLEL_LINEAR: _linear_source("RowParallelLinear"),
    ops.MLA_UP_PROJECTION: _linear_source(f"q_up_proj / kv_up_proj of {FLEET_MLA}, viewed per head"),
    ops.RMS_NORM: (f"gate on: {SEED_ISLANDS} (PaddleFleet's RMSNorm, {FLEET_NORM}, has no gated branch: with the gate "
                   "on or off it calls fused_rms_norm_ext, a GPU kernel); gate off: fused_rms_norm_ext cast to the "
                   "weight's dtype, as that file's RMSNorm.forward"),
    ops.SWIGLU: (f"{FLEET_MLP} MLP.forward -> {FLEET_SWIGLU}: gate on, bias_swiglu_impl / weighted_bias_swiglu_impl "
                 "with use_accuracy_compatible (swiglu_eager, swiglu_back_eager / weighted_swiglu_back_eager; bf16 "
                 "silu and sigmoid on a CPU computed in fp32 and rounded once); gate off: F.swiglu, the scale in fp32 "
                 "under autograd (not that file's weighted_swiglu_back)"),
    ops.SHARED_EXPERT_MLP: (f"{FLEET_MLP} MLP.forward at TP=1: fc1 and fc2 as the linears (F.linear, autograd; "
                            f"PaddleFleet's layers run their own backward), the gated SwiGLU of {FLEET_SWIGLU}"),
    ops.ROUTED_EXPERTS: (f"{FLEET_EXPERTS} FusionMoeNode under the gate with split per-expert GEMMs: fwd_down_bf16's "
                         "fp32 SwiGLU x prob and bwd_down_input_bf16's backward (fp32 autograd, prob grad in float64), "
                         "each GEMM's input grad on the materialised transpose; the weight grads as autograd's (the "
                         "node's own bf16 weight-grad path is not followed), tokens split by "
                         "harness.case.ops.uneven_split"),
    ops.MOE_ROUTER: (f"{FLEET_ROUTER} TopKRouter.forward with use_accuracy_compatible (noaux_tc, one group, sigmoid, "
                     "norm_topk_prob, no aux or z loss): FusedGateDetachMatmul, gather_nd, float64 normalisation sum"),
    ops.EMBEDDING: f"{FLEET_EMBEDDING} VocabParallelEmbedding.forward at TP=1: weight[ids] under the gate, else "
                   "F.embedding",
    ops.ATTENTION_SCORES: (f"{FLEET_ATTENTION} DotProductAttention's unfused core (baddbmm, alpha = 1/sqrt(d)) and "
                           f"{FLEET_SOFTMAX} FusedScaleMaskSoftmax's unfused path (causal mask -10000, fp32 softmax)"),
    ops.CORE_ATTENTION: f"{FLEET_ATTENTION} DotProductAttention's explicit path (baddbmm, fp32 softmax, bmm)",
    ops.YARN_ROPE: f"{FLEET_MLA} rope path without fusion: {FLEET_YARN} table, {FLEET_ROPE} rotation",
    ops.MOE_COMBINE: (f"{FLEET_MOE_LAYER} custom_forward combine: {FLEET_MOE_UTILS} permute / unpermute, plus the "
                      "shared expert's output"),
    ops.LM_HEAD_LOSS: f"{FLEET_LM_HEAD} GPTLMHead (F.linear under the gate) and {FLEET_LOSS} LanguageLoss at TP=1",
}


def source(request) -> str:
    """What this op's recipe follows (meta.json ``paddle_source``)."""
    return SOURCES[ops.OPS[request["op"]]]


def unavailable(request):
    """The recipe runs wherever Paddle does; a kernel missing on the device is found when it runs (UNSUPPORTED)."""
    return None


IMPLEMENTATIONS = {
    ops.COLUMN_PARALLEL_LINEAR: linear, ops.ROW_PARALLEL_LINEAR: linear, ops.RMS_NORM: rms_norm, ops.SWIGLU: swiglu,
    ops.EMBEDDING: embedding, ops.MOE_ROUTER: moe_router, ops.ATTENTION_SCORES: attention_scores,
    ops.SHARED_EXPERT_MLP: shared_expert_mlp, ops.ROUTED_EXPERTS: routed_experts,
    ops.MLA_UP_PROJECTION: mla_up_projection, ops.YARN_ROPE: yarn_rope, ops.CORE_ATTENTION: core_attention,
    ops.MOE_COMBINE: moe_combine, ops.LM_HEAD_LOSS: lm_head_loss,
}
