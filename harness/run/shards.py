"""Turn the per-rank files of a tensor-parallel run into the canonical files the comparator reads.

Each rank wrote ``outputs.rank<R>.safetensors`` and ``meta.rank<R>.json``. Split tensors are concatenated
along the op's partition dim; replicated ones (every rank holds the whole tensor, e.g. an all-reduced
input grad) must be bitwise identical on every rank, and a rank that disagrees is reported, not hidden.
The gathered ``outputs.safetensors`` and a merged ``meta.json`` land in the side's folder, so everything
after this step treats a TP=N run like a TP=1 run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from harness.case.checkpoints import CheckpointError, load_tensors
from harness.run.protocol import META, OUTPUTS, rank_file_name


class GatherError(RuntimeError):
    """Rank files that cannot be put together; the message names the file and tensor."""


def rank_metas(folder: Path, world: int) -> dict[int, dict]:
    """The metas the ranks managed to write, by rank (a rank that died writes none)."""
    metas = {}
    for rank in range(world):
        try:
            metas[rank] = json.loads((folder / rank_file_name(META, rank, world)).read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return metas


def merge_metas(folder: Path, world: int, launch: dict) -> dict:
    """Rank 0's provenance for the side, each rank's phases and status, and the launch; written as meta.json.
    ``unsupported`` only when every rank said so; ``unsupported_on_some_ranks`` says which did not."""
    metas = rank_metas(folder, world)
    if not metas:
        return {}
    merged = {key: value for key, value in metas[min(metas)].items() if key != "unsupported"}
    merged["launch"] = launch
    merged["ranks"] = {str(r): {"phases": m.get("phases", {}), "unsupported": m.get("unsupported")}
                       for r, m in metas.items()}
    unsupported = {r: m["unsupported"] for r, m in metas.items() if m.get("unsupported")}
    if len(unsupported) == world:  # the side is UNSUPPORTED only when every rank says so
        merged["unsupported"] = unsupported[0]
    elif unsupported:  # another rank crashed, or ran on: that is the side's outcome, not the first rank's reason
        said = min(unsupported)
        others = [f"rank {r} " + ("ran to its end" if r in metas else "wrote no meta.json (it crashed)")
                  for r in range(world) if r not in unsupported]
        merged["unsupported_on_some_ranks"] = (f"{', '.join(others)} while rank {said} said UNSUPPORTED: "
                                               f"{unsupported[said]}")
    (folder / META).write_text(json.dumps(merged, indent=2, sort_keys=True, default=str))
    return merged


def gather(folder: Path, world: int, output_names: list[str], partition: dict[str, int | None]) -> dict:
    """Write the canonical outputs.safetensors from the rank files; return the per-tensor cross-rank check."""
    shards = []
    for rank in range(world):
        path = folder / rank_file_name(OUTPUTS, rank, world)
        try:
            shards.append(load_tensors(path))
        except CheckpointError as error:
            raise GatherError(str(error)) from None
    gathered, checks = {}, {}
    for name in output_names:
        missing = [r for r, shard in enumerate(shards) if name not in shard]
        if missing:
            raise GatherError(f"{folder / rank_file_name(OUTPUTS, missing[0], world)} lacks tensor {name!r}")
        if name not in partition:
            raise GatherError(f"the op declares no partition dim for output {name!r}: cannot gather it")
        parts = [shard[name] for shard in shards]
        dim = partition[name]
        if dim is None:
            gathered[name], checks[name] = parts[0], replicated_check(parts)
        else:
            try:
                gathered[name] = np.ascontiguousarray(np.concatenate(parts, axis=dim))
            except ValueError as error:
                raise GatherError(f"{folder}: shards of {name!r} do not fit together on dim {dim}: {error}") from None
            checks[name] = {"split_dim": dim, "shard_shape": list(parts[0].shape)}
    save_file(gathered, str(folder / OUTPUTS))
    return checks


def replicated_check(parts: list[np.ndarray]) -> dict:
    """Count, per rank, the elements whose bits differ from rank 0's copy of a tensor every rank should share."""
    width = parts[0].dtype.itemsize
    reference = parts[0].view(f"u{width}")
    differing = {str(r): int(np.count_nonzero(p.view(f"u{width}") != reference))
                 for r, p in enumerate(parts[1:], start=1) if p.shape == parts[0].shape}
    shapes_differ = [r for r, p in enumerate(parts) if p.shape != parts[0].shape]
    identical = not shapes_differ and not any(differing.values())
    return {"replicated": True, "identical_across_ranks": identical,
            "mismatches_vs_rank0": differing, "ranks_with_other_shape": shapes_differ}


def inconsistent(checks: dict) -> list[str]:
    """Names of replicated tensors whose copies differ between ranks."""
    return [name for name, check in checks.items() if check.get("replicated") and not check["identical_across_ranks"]]


def departures(checks: dict) -> dict[int, list[str]]:
    """{rank: the replicated tensors whose copy on it differs from rank 0's (bits or shape)}, ranks in order."""
    found: dict[int, list[str]] = {}
    for name in inconsistent(checks):
        check = checks[name]
        ranks = {int(r) for r, count in check["mismatches_vs_rank0"].items() if count}
        for rank in sorted(ranks | set(check["ranks_with_other_shape"])):
            found.setdefault(rank, []).append(name)
    return dict(sorted(found.items()))
