"""A nightly spread over hosts: ``nightly --shard i/n`` runs every n-th case (from the i-th, 1-based, in the
registry's order); ``harness.commands.nightly_merge`` puts the shards' run directories back together."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def shard_spec(text: str) -> tuple[int, int]:
    """``--shard 2/4``: the second of four shards."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"expects I/N with 1 <= I <= N, e.g. 1/2 (got {text!r})")
    return index, count


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects a positive integer (got {text!r})")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("--workers", type=positive, default=1,
                        help="cells at once; on a GPU host each takes its own GPUs (TP cells take TP of them) "
                             "of CUDA_VISIBLE_DEVICES")
    parser.add_argument("--cells-per-gpu", type=positive, default=1, metavar="K",
                        help="with --workers on a GPU host: up to K cells share a GPU (each in processes of its "
                             "own: the same bits, shared memory; harness.run.placement)")
    parser.add_argument("--shard", type=shard_spec, metavar="I/N",
                        help="run only shard I of N (every N-th case); merge with `nightly-merge`")


def select(cases: Sequence, shard: tuple[int, int] | None) -> list:
    if shard is None:
        return list(cases)
    index, count = shard
    return list(cases[index - 1::count])


def describe(shard: tuple[int, int] | None, cases: Sequence) -> dict | None:
    if shard is None:
        return None
    return {"index": shard[0], "count": shard[1], "cases": [case.name for case in cases]}
