"""Stand-in for src/paddlefleet/fusions/fused_bias_swiglu.py@d522e07b: the two entry points MLP.forward calls, with
their signatures; the arithmetic is a plain silu(gate) * up (* weights) under autograd."""

import paddle
import paddle.nn.functional as F

from paddlefleet import record


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False, clamp_value=None,
                     use_accuracy_compatible=False):
    record("paddlefleet.fusions.fused_bias_swiglu.bias_swiglu_impl", bias=bias, clamp_value=clamp_value,
           use_accuracy_compatible=use_accuracy_compatible, shape=list(input.shape))
    assert len(input.shape) in [2, 3]
    gate, up = paddle.chunk(input, 2, axis=-1)
    return F.silu(gate) * up


def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False, clamp_value=None,
                              use_accuracy_compatible=False):
    record("paddlefleet.fusions.fused_bias_swiglu.weighted_bias_swiglu_impl", bias=bias, clamp_value=clamp_value,
           use_accuracy_compatible=use_accuracy_compatible, shape=list(input.shape), weights_shape=list(weights.shape))
    assert len(input.shape) in [2, 3] and bias is None
    gate, up = paddle.chunk(input, 2, axis=-1)
    return (F.silu(gate) * up * weights).astype(input.dtype)
