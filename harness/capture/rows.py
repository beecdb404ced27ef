"""The first sequence's part of a model's outputs when it ran on a batch of sequences (``--versus batch`` on a model
case, ``harness.case.batch``): side b runs the case's sequence first in a batch, and writes only that sequence's
module outputs, in the shapes a run of the sequence alone writes. Framework-free: only shapes and slices, so a torch
or a paddle tensor goes through alike."""

import re

import numpy as np

EXPERT_BATCH_WHY = ("a routed expert's output holds the tokens of every sequence in the batch that its router sent "
                    "it: not one sequence's; the MoE block's output is compared")


def first_sequence(tensor, sequences: int, tokens: int, sequence_first: bool):
    """Sequence 0 of `tensor`: ``[b, s, ...]`` -> ``[s, ...]`` (``[s, b, ...]`` where `sequence_first`, Megatron's
    layout), or its tokens of a flattened ``[b * s, ...]`` (``[s * b, ...]``); a tensor without those dims is
    refused, naming its shape."""
    shape = tuple(tensor.shape)
    if sequences == 1:
        return tensor
    if len(shape) >= 2 and shape[:2] == ((tokens, sequences) if sequence_first else (sequences, tokens)):
        return tensor[:, 0] if sequence_first else tensor[0]
    if shape and shape[0] == sequences * tokens:
        return tensor[0::sequences] if sequence_first else tensor[:tokens]
    raise ValueError(f"a module output of shape {list(shape)} has no dims of {sequences} sequences of {tokens} "
                     f"tokens ({'sequence' if sequence_first else 'batch'} first)")


def first_sequence_only(tensors: dict, count: int, tokens: int, sequence_first: bool,
                        keep: int | None = None) -> dict[str, str]:
    """Under ``--versus batch`` or ``pad`` (`count` > 1 sequences of `tokens`): every module output
    (``module.<canonical>``) cut, in place, to the first sequence's first `keep` tokens (the sequence without its
    padding; default all); a routed expert's output, which mixes the sequences' tokens, dropped. {canonical: why} of
    those dropped, for the runner's ``not_captured``."""
    if count == 1 and keep in (None, tokens):
        return {}
    dropped = {name: EXPERT_BATCH_WHY for name in tensors if name.startswith("module.")
               and re.search(r"\.experts\.\d+$", name)}
    for name in list(tensors):
        if name in dropped:
            del tensors[name]
        elif name.startswith("module."):
            cut = first_sequence(tensors[name], count, tokens, sequence_first)[:keep]
            tensors[name] = cut.contiguous() if hasattr(cut, "contiguous") else np.ascontiguousarray(cut)
    return {name.removeprefix("module."): why for name, why in dropped.items()}
