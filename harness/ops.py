"""What each op reads and writes, in canonical names and layout, independent of any framework.

The checkpoint generator, the runners and the output validator all take shapes from here, so a
new op is one entry in ``OPS`` plus one function in each runner's op table.

Canonical layout is Megatron's: a linear weight is ``[out, in]``; activations are ``[tokens, hidden]``
(a runner may reshape to its framework's own convention and must reshape back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str  # "weight" | "input" | "grad" (an upstream gradient fed to backward)


@dataclass(frozen=True)
class OpSpec:
    name: str
    shape_fields: tuple[str, ...]
    inputs: Callable[[Mapping[str, int], int, Mapping[str, object]], list[TensorSpec]]
    outputs: Callable[[Mapping[str, int], int, Mapping[str, object]], list[TensorSpec]]
    tp_split_field: str  # the shape field that tensor parallelism divides
    # Canonical dim each input and output is split on across tensor-parallel ranks, None where every rank
    # holds the whole tensor (replicated, or already all-reduced); the harness gathers shards with it.
    partition: Callable[[Mapping[str, object]], dict[str, int | None]] = lambda config: {}


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


OPS: dict[str, OpSpec] = {
    "column_parallel_linear": OpSpec(
        "column_parallel_linear", ("input_size", "output_size"), _linear_inputs, _linear_outputs, "output_size",
        _column_partition,
    ),
    "row_parallel_linear": OpSpec(
        "row_parallel_linear", ("input_size", "output_size"), _linear_inputs, _linear_outputs, "input_size",
        _row_partition,
    ),
}
