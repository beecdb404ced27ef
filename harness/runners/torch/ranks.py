"""A torch training run on several ranks (data and expert parallel, docs/training-ranks.md): the global batch's
micro-batches per rank, and the canonical state put back together on rank 0, which writes the step.

Every collective here copies bits and computes nothing: ``all_gather_object`` / ``gather_object`` of tensors moved to
the host (gloo, whatever the training's backend: a group of its own, made by ``gather_group``). A step's canonical
loss is each micro-batch's share of the global step's loss in the global micro-batch order (``global_losses``); a
tensor held in pieces (a distributed optimizer's shard of a flattened parameter, an expert on its expert-parallel
rank) is assembled on rank 0 from every rank's pieces, which must cover it exactly once (``assemble``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_group():
    """A gloo group over every rank (all ranks must call it), or None on one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def everyone(value, group) -> list:
    """`value` from every rank, in rank order (pickled: tensors must be on the host)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def global_losses(local: torch.Tensor, dp: int, group) -> torch.Tensor:
    """The step's losses in global micro-batch order from each rank's own (rank r trained micro-batches r, r + dp,
    ...: harness.case.train_settings.rank_micro_batches), each divided by dp: a rank backpropagates its micro-batches'
    mean over its own count, and its gradients are averaged over the dp ranks, so a micro-batch's share of the global
    step's loss is its local loss / dp (exact for dp a power of two)."""
    if group is None:
        return local
    per_rank = everyone(local.detach().cpu(), group)
    ordered = torch.stack([per_rank[m % dp][m // dp] for m in range(dp * local.numel())])
    return (ordered / dp).to(local.device)


def assemble(name: str, shape, pieces: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """The whole tensor from (start, end, flat values) pieces of its flattened elements; they must cover it once."""
    numel = 1
    for size in shape:
        numel *= size
    ordered, at = sorted(pieces, key=lambda piece: piece[0]), 0
    for start, end, values in ordered:
        if start != at or values.numel() != end - start:
            raise RuntimeError(f"{name}: the ranks' pieces do not tile its {numel} elements (a piece {start}:{end} "
                               f"of {values.numel()} values where element {at} was next)")
        at = end
    if at != numel:
        raise RuntimeError(f"{name}: the ranks' pieces cover {at} of its {numel} elements")
    return torch.cat([values.reshape(-1) for _, _, values in ordered]).view(*shape)


def to_rank0(value, group) -> list | None:
    """`value` from every rank, in rank order, on rank 0; None on the others (pickled: tensors must be on the host)."""
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(value, out, dst=0, group=group)
    return out


def gather_pieces(pieces: dict[str, list[tuple[int, int, torch.Tensor]]], shapes: dict, group,
                  device) -> tuple[dict, dict]:
    """`pieces`: {name: [(start, end, flat values)]} this rank holds (several of one tensor where its elements lie
    apart in the stack's own tensor: q, k or v interleaved in Megatron's linear_qkv). On rank 0: ({name: whole tensor
    on `device`} for every name some rank holds a piece of (`shapes`: name -> shape), {name: [(start, end)] of the
    pieces the other ranks hold}); on the others ({}, {}), their pieces sent."""
    # a clone each: pickling a view pickles its whole storage (a piece of Megatron's flat buffer would carry all of it)
    held = to_rank0({n: [(s, e, t.detach().cpu().clone()) for s, e, t in ps] for n, ps in pieces.items()}, group)
    if held is None:
        return {}, {}
    by_name: dict[str, list] = {}
    places: dict[str, list] = {}
    for rank, mine in enumerate(held):
        for name, owned in mine.items():
            by_name.setdefault(name, []).extend(owned)
            if rank:
                places.setdefault(name, []).extend(piece[:2] for piece in owned)
    return {name: assemble(name, shapes[name], parts).to(device) for name, parts in by_name.items()}, places
