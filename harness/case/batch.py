"""A case's rows inside a bigger batch (``--versus batch=M``): the inputs side b reads and the rows it is judged on.

Side a runs the case's T rows alone; side b runs the same rows first in a batch of T + M, the M other rows drawn as
the case at T + M tokens draws them (random), their upstream gradients zero as a padded token's are. Every row's
outputs, and the weight gradients (the other rows add exact zeros to them), are then the same sums as side a's: a
bit that moves is the batch's doing. A tensor's rows are the dims whose size is the token count; an op whose record
says its rows mix by definition (``Op.batch_mixed``: a mean loss, a fixed split of the tokens among experts) is
refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.case import generate
from harness.case.checkpoints import Checkpoint, load_tensors, write_tensors
from harness.case.registry import Case, CaseError

BATCH_INPUTS = "batch-inputs.safetensors"  # side b's token-dependent inputs, in the run's own folder


def batched(case: Case, others: int) -> Case:
    """The case side b runs: its rows and `others` more; refused where a row's outputs depend on other rows by
    definition."""
    where = f"{case.source}: case {case.name!r}"
    if case.op_spec.batch_mixed:
        raise CaseError(f"{where}: --versus batch: op {case.op!r} mixes its rows by definition "
                        f"({case.op_spec.batch_mixed})")
    if case.tp != 1:
        raise CaseError(f"{where}: --versus batch runs at TP=1 (field 'tp' is {case.tp})")
    if not isinstance(others, int) or isinstance(others, bool) or others < 1:
        raise CaseError(f"{where}: --versus batch expects a count of other rows of at least 1 (got {others!r})")
    big = case.with_tokens(case.tokens + others)
    row_dims(case, big)  # every token-dependent dim must be a row dim
    return big


def row_dims(case: Case, big: Case) -> dict[str, tuple[int, ...]]:
    """Per tensor (inputs and outputs), the dims that hold one entry per row: their size is the token count."""
    found = {}
    small_specs = [*case.input_specs(), *case.output_specs()]
    big_specs = {spec.name: spec for spec in [*big.input_specs(), *big.output_specs()]}
    for spec in small_specs:
        shape = big_specs[spec.name].shape
        dims = tuple(d for d, (n, m) in enumerate(zip(spec.shape, shape, strict=True)) if n != m)
        if any(spec.shape[d] != case.tokens or shape[d] != big.tokens for d in dims):
            raise CaseError(f"{case.source}: case {case.name!r}: --versus batch: tensor {spec.name!r} of op "
                            f"{case.op!r} grows from {list(spec.shape)} to {list(shape)} with the token count, not "
                            "one entry per row")
        found[spec.name] = dims
    return found


def write_inputs(case: Case, big: Case, checkpoint: Checkpoint, folder: Path) -> Path:
    """Side b's token-dependent inputs, written in `folder` (the run's own): the case's rows first, then the other
    rows as the big case draws them, upstream gradients zero there."""
    dims, drawn = row_dims(case, big), generate.plans(big)
    roles = {spec.name: spec.role for spec in case.input_specs()}
    plans = []
    for name, rows in load_tensors(checkpoint.path).items():
        array = rows
        if dims[name]:
            array = np.zeros_like(rows, shape=drawn[name].shape) if roles[name] == "grad" else \
                np.array(generate.draw(drawn[name]))
            array[rows_slice(dims[name], case.tokens, array.ndim)] = rows
        plans.append(generate.Plan(name, array.shape, array.dtype, case.seed, array=array))
    path = folder / BATCH_INPUTS
    write_tensors(path, plans)
    return path


def rows_of(case: Case, big: Case, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Side b's outputs cut to the case's rows (a tensor without a row dim whole)."""
    dims = row_dims(case, big)
    return {name: np.ascontiguousarray(array[rows_slice(dims.get(name, ()), case.tokens, array.ndim)])
            for name, array in outputs.items()}


def rows_slice(dims: tuple[int, ...], tokens: int, ndim: int) -> tuple[slice, ...]:
    return tuple(slice(0, tokens) if d in dims else slice(None) for d in range(ndim))


# --- the model level: the case's sequence alone against the same sequence first in a batch of 1 + M sequences ---

MODEL_RUNNERS = ("hf_model", "megatron_model", "paddle_model")  # the model runners that take a batch of sequences
PAD_RUNNERS = ("hf_model", "megatron_model")  # those that also take an attention mask (--versus pad)
CACHE_RUNNERS = ("hf_model",)  # the model runners with a KV cache (--versus cache)
CACHE_OUTPUTS = ("logits", "loss")  # what a forward through the cache gives: no backward, every module runs per chunk
IGNORE = -100  # a label the loss leaves out (HF's and Megatron's ignore index)


def check_model(case: Case, others: int) -> None:
    """Refuse what the model level cannot batch: a count below 1, a sequence of one token (its rows would be
    ambiguous with the batch's)."""
    where = f"{case.source}: case {case.name!r}"
    if not isinstance(others, int) or isinstance(others, bool) or others < 1:
        raise CaseError(f"{where}: --versus batch expects a count of other sequences of at least 1 (got {others!r})")
    if case.tokens < 2:
        raise CaseError(f"{where}: --versus batch on a model needs at least 2 tokens (field 'tokens' is "
                        f"{case.tokens})")


def write_sequences(case: Case, others: int, checkpoint: Checkpoint, folder: Path) -> Path:
    """Side b's ``input_ids`` and ``labels``, ``[1 + others, T]``, written in `folder` (the run's own): row 0 the
    case's sequence, the other rows' ids drawn as the case at ``(1 + others) * T`` tokens draws its ids, their labels
    all ignored (-100): their loss weight is zero, so the loss is the case's sequence's mean and every parameter
    gradient is the same sum as side a's, the other sequences adding exact zeros."""
    check_model(case, others)
    tokens, rows = case.tokens, 1 + others
    drawn = generate.draw(generate.plans(case.with_tokens(rows * tokens))["input_ids"]).reshape(rows, tokens)
    alone = load_tensors(checkpoint.path)
    ids, labels = drawn.copy(), np.full((rows, tokens), IGNORE, dtype=np.int64)
    ids[0], labels[0] = alone["input_ids"], alone["labels"]
    plans = [generate.Plan(name, array.shape, array.dtype, case.seed, array=array)
             for name, array in (("input_ids", ids), ("labels", labels))]
    path = folder / BATCH_INPUTS
    write_tensors(path, plans)
    return path


def write_padded(case: Case, pad: int, checkpoint: Checkpoint, folder: Path) -> Path:
    """Side b's inputs under ``--versus pad=P``: a batch of two sequences of ``T + P`` tokens, the case's sequence
    first, right-padded with P tokens of id 0 that its ``attention_mask`` masks and its labels ignore, then one other
    sequence drawn as for ``--versus batch=1`` (at ``T + P`` tokens), its labels all ignored."""
    where = f"{case.source}: case {case.name!r}"
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 1:
        raise CaseError(f"{where}: --versus pad expects a count of padding tokens of at least 1 (got {pad!r})")
    tokens = case.tokens + pad
    drawn = generate.draw(generate.plans(case.with_tokens(2 * tokens))["input_ids"]).reshape(2, tokens)
    alone = load_tensors(checkpoint.path)
    ids, labels = drawn.copy(), np.full((2, tokens), IGNORE, dtype=np.int64)
    mask = np.ones((2, tokens), dtype=np.int64)
    ids[0, case.tokens:], mask[0, case.tokens:] = 0, 0
    ids[0, :case.tokens], labels[0, :case.tokens] = alone["input_ids"], alone["labels"]
    plans = [generate.Plan(name, array.shape, array.dtype, case.seed, array=array)
             for name, array in (("input_ids", ids), ("labels", labels), ("attention_mask", mask))]
    path = folder / BATCH_INPUTS
    write_tensors(path, plans)
    return path


def check_chunk(case: Case, chunk: int) -> None:
    """``--versus cache=C``: C tokens a pass, at least 1 and fewer than the sequence's (one pass is no cache)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk < case.tokens:
        raise CaseError(f"{case.source}: case {case.name!r}: --versus cache expects a chunk of 1 to "
                        f"{case.tokens - 1} tokens (field 'tokens' is {case.tokens}; got {chunk!r})")
