"""A named variant of the reference recipe (``config.paddle_impl = "fp32_islands"``; ``auto`` never picks it): the
FP32 islands of the seed PR's first revision, which PaddleFleet's code does not have, kept because they are the
design that aligns with Megatron's fp32 SwiGLU; compared with the recipe like any other level
(``python -m harness compare CASE --paddle-impl recipe --versus-impl fp32_islands``).

Under the gate, SwiGLU (with and without the per-token scale), the shared expert's activation and the routed
experts' SwiGLU x prob are each an island: cast to fp32, silu(gate) * up (* scale), cast back once, the backward by
autograd. Gate off, and for every other op, it is the recipe (``recipe.py``). Imports paddle: runner side only.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from harness.case import ops
from harness.runners.paddle import recipe
from harness.runners.paddle.common import as_tensor, run_phases

ISLAND_OPS = (ops.SWIGLU, ops.SHARED_EXPERT_MLP, ops.ROUTED_EXPERTS)
ISLAND = "FP32-island SwiGLU (the seed PR's first revision): cast fp32, silu(gate) * up"


def swiglu_island(y, scale=None):
    gate_half, up = paddle.chunk(y.astype("float32"), 2, axis=-1)
    out = F.silu(gate_half) * up
    if scale is not None:
        out = out * scale.unsqueeze(-1)
    return out.astype(y.dtype)


def swiglu(request, tensors, gate, phases, guard):
    if not gate:
        return recipe.swiglu(request, tensors, gate, phases, guard)
    x = as_tensor(tensors["input"])
    scale = as_tensor(tensors["per_token_scale"]) if "per_token_scale" in tensors else None
    out = run_phases(request, phases, guard, "FP32-island SwiGLU", lambda: swiglu_island(x, scale),
                     lambda o: o.backward(as_tensor(tensors["grad_output"], False)))
    outputs = {"out": out.numpy(), "grad.input": x.grad.numpy()}
    if scale is not None:
        outputs["grad.per_token_scale"] = scale.grad.numpy()
    return outputs, (f"paddle dygraph {ISLAND}{' * scale' if scale is not None else ''}, cast back once, autograd "
                     f"(use_accuracy_compatible={gate})")


def shared_expert_mlp(request, tensors, gate, phases, guard):
    island = (swiglu_island, ISLAND) if gate else None
    return recipe.shared_expert_mlp(request, tensors, gate, phases, guard, activation=island)


def routed_experts(request, tensors, gate, phases, guard):
    return recipe.routed_experts(request, tensors, gate, phases, guard,
                                 activation=(swiglu_island, ISLAND + " * prob, autograd"))


def source(request) -> str:
    """What this op follows at this level (meta.json ``paddle_source``)."""
    op = ops.OPS[request["op"]]
    if op in ISLAND_OPS:
        return (f"gate on: {recipe.SEED_ISLANDS}: the SwiGLU is an FP32 island, autograd backward; otherwise as the "
                f"recipe: {recipe.SOURCES[op]}")
    return recipe.source(request)


def unavailable(request):
    return recipe.unavailable(request)


IMPLEMENTATIONS = {
    **recipe.IMPLEMENTATIONS, ops.SWIGLU: swiglu, ops.SHARED_EXPERT_MLP: shared_expert_mlp,
    ops.ROUTED_EXPERTS: routed_experts,
}
