"""What every family's layout shares: its canonical gradients made from its parameter list (HF checkpoint names),
gate and up fused as Megatron fuses them, in the order a backward makes them. Framework-free."""

from __future__ import annotations


def gradients(parameters: list[tuple[str, tuple[int, ...], str]]) -> list[tuple[str, tuple[int, ...]]]:
    """("grad.<name>", shape) of every trained parameter of `parameters` ((name, shape, kind) in forward order):
    buffers and hash tables have none; an MLP's ``gate_proj`` and ``up_proj`` give one ``gate_up_proj`` ([2F, H],
    gate rows first), as Megatron's linear_fc1 holds them. Backward order: the reverse of the forward order, except
    that each MoE layer's experts stay ascending (down_proj before gate_up_proj: autograd meets fc2 first), so a
    report reads expert by expert."""
    pending: list[tuple[str, tuple[int, ...]]] = []
    for name, shape, kind in parameters:
        mlp = ".mlp." in name  # an MLP's gate and up (not DeepSeek-V4's compressor.gate_proj)
        if kind in ("buffer", "hash") or mlp and name.endswith("up_proj.weight") and not name.endswith(
                "gate_up_proj.weight"):
            continue  # no gradient; up_proj is fused into gate_proj's entry
        if mlp and name.endswith("gate_proj.weight"):
            name, shape = name.replace("gate_proj", "gate_up_proj"), (2 * shape[0], *shape[1:])
        pending.append((name, shape))
    grads: list[tuple[str, tuple[int, ...]]] = []
    i = len(pending) - 1
    while i >= 0:
        name, shape = pending[i]
        if ".mlp.experts." in name:
            j = i
            while j >= 0 and ".mlp.experts." in pending[j][0]:
                j -= 1
            block = pending[j + 1:i + 1]
            for k in range(0, len(block), 2):
                grads += [block[k + 1], block[k]]
            i = j
            continue
        grads.append((name, shape))
        i -= 1
    return [("grad." + n, s) for n, s in grads]
