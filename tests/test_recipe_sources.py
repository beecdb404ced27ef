"""The reference recipe (harness.runners.paddle.recipe) names what it follows for every op, and computes in the
rounding order of the PaddleFleet code it cites: the router's normalisation sum in float64, the gated SwiGLU's
silu(gate) * up in the input dtype with PaddleFleet's hand-written backward. The expectations are rebuilt here in
numpy from the same elementwise values (IEEE float32 arithmetic, ml_dtypes rounding); each test also checks that the
rounding order it pins changes bits on its inputs, so it can fail. docs/paddle-levels.md has the check against
PaddleFleet's own code."""

import contextlib
import re

import ml_dtypes
import numpy as np
import pytest

from harness.case import ops

paddle = pytest.importorskip("paddle")
F = paddle.nn.functional


def _run(op_name, tensors, shapes, dtype="float32", **config):
    from harness.runners.paddle import recipe

    request = {"op": op_name, "dtype": dtype, "device": "cpu", "tokens": next(iter(tensors.values())).shape[0],
               "shapes": shapes, "config": ops.OPS[op_name].resolve(config)}
    return recipe.IMPLEMENTATIONS[ops.OPS[op_name]](request, tensors, True, lambda name: contextlib.nullcontext(),
                                                    lambda call, kernel, request: call())[0]


def test_every_recipe_names_its_source_and_every_level_says_what_it_follows():
    from harness.runners.paddle import fleet, islands, recipe

    assert set(recipe.SOURCES) == set(recipe.IMPLEMENTATIONS)
    for op, text in recipe.SOURCES.items():
        cited = re.findall(r"src/paddlefleet/\S+@([0-9a-f]{40})", text)
        assert cited or "seed PR" in text, op.name
    assert "seed PR" in recipe.SOURCES[ops.RMS_NORM] and "no gated branch" in recipe.SOURCES[ops.RMS_NORM]
    request = {"op": "swiglu"}
    assert "fused_bias_swiglu.py@d522e07b" in recipe.source(request) and "seed PR" in islands.source(request)
    assert islands.source({"op": "moe_router"}) == recipe.source({"op": "moe_router"})
    assert fleet.STAND_IN_ONLY in fleet.source(request)


def test_the_router_normalises_by_a_float64_sum_cast_to_float32():
    """moe_router.py@01ae3ccf under the gate: top_gate / (float32(float64 sum) + 1e-20) * scaling. One-hot inputs make
    the logits exactly the weight's entries, so the expectation is rebuilt from Paddle's own sigmoid of them."""
    tokens, experts, k, scaling = 16, 32, 8, 2.827
    rng = np.random.default_rng(11)
    weight = rng.normal(0, 2, (experts, tokens)).astype(np.float32)  # [experts, hidden], hidden = tokens
    tensors = {"input": np.eye(tokens, dtype=np.float32), "weight": weight,
               "expert_bias": np.zeros(experts, np.float32), "grad_probs": np.ones((tokens, experts), np.float32)}
    out = _run("moe_router", tensors, {"hidden_size": tokens, "num_experts": experts, "topk": k},
               topk_scaling_factor=scaling)
    scores = F.sigmoid(paddle.to_tensor(np.ascontiguousarray(weight.T))).numpy()
    chosen = np.sort(np.argsort(-scores, axis=-1, kind="stable")[:, :k], axis=-1)
    assert (out["topk_indices"] == chosen).all()
    picked = np.take_along_axis(scores, chosen, axis=-1)
    sum64 = picked.astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32) + np.float32(1e-20)
    sum32 = picked.sum(axis=-1, keepdims=True, dtype=np.float32) + np.float32(1e-20)
    expected = picked / sum64 * np.float32(scaling)
    assert (np.take_along_axis(out["probs"], chosen, axis=-1).view(np.uint32) == expected.view(np.uint32)).all()
    assert (picked / sum32 * np.float32(scaling) != expected).any()  # a float32 sum would give other bits here


def _swiglu_inputs(dtype, tokens=16, ffn=64, seed=5):
    rng = np.random.default_rng(seed)
    x, g = rng.normal(0, 2, (tokens, 2 * ffn)), rng.normal(0, 0.1, (tokens, ffn))
    if dtype == "bfloat16":
        return {"input": x.astype(ml_dtypes.bfloat16).view(np.uint16),
                "grad_output": g.astype(ml_dtypes.bfloat16).view(np.uint16)}
    return {"input": x.astype(np.float32), "grad_output": g.astype(np.float32)}


def test_the_gated_swiglu_rounds_silu_and_the_product_in_bf16():
    """fused_bias_swiglu.py@d522e07b swiglu_eager: silu(gate) rounded to bf16, times up, rounded again (bf16 silu on
    a CPU: fp32 then one rounding, as Paddle's CUDA kernel)."""
    tensors = _swiglu_inputs("bfloat16")
    out = _run("swiglu", tensors, {"ffn_hidden_size": 64}, "bfloat16")["out"]
    x = tensors["input"].view(ml_dtypes.bfloat16).astype(np.float32)
    gate, up = np.split(x, 2, axis=-1)
    silu = F.silu(paddle.to_tensor(gate)).numpy().astype(ml_dtypes.bfloat16).astype(np.float32)
    expected = (silu * up).astype(ml_dtypes.bfloat16)
    assert (out.view(np.uint16) == expected.view(np.uint16)).all()
    once = (F.silu(paddle.to_tensor(gate)).numpy() * up).astype(ml_dtypes.bfloat16)
    assert (once.view(np.uint16) != expected.view(np.uint16)).any()  # the FP32 island rounds once: other bits


def test_the_gated_swiglu_backward_is_paddlefleets_hand_written_one():
    """swiglu_back_eager, term by term in float32: g * s * (1 + a * (1 - s)) * b and g * silu(a), s = sigmoid(a)."""
    tensors = _swiglu_inputs("float32")
    grad = _run("swiglu", tensors, {"ffn_hidden_size": 64})["grad.input"]
    a, b = np.split(tensors["input"], 2, axis=-1)
    g, one = tensors["grad_output"], np.float32(1)
    s = F.sigmoid(paddle.to_tensor(a)).numpy()
    expected = np.concatenate([g * s * (one + a * (one - s)) * b, g * F.silu(paddle.to_tensor(a)).numpy()], axis=-1)
    assert (grad.view(np.uint32) == expected.view(np.uint32)).all()
    x = paddle.to_tensor(tensors["input"], stop_gradient=False)
    gate, up = paddle.chunk(x, 2, axis=-1)
    (F.silu(gate) * up).backward(paddle.to_tensor(g))
    assert (x.grad.numpy().view(np.uint32) != expected.view(np.uint32)).any()  # autograd would give other bits
