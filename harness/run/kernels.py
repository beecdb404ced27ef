"""Which oneDNN kernels a CPU runner executed, read from oneDNN's own verbose log in the runner's stdout.

Both torch and Paddle run their CPU bf16 GEMMs through oneDNN; two results can only be bitwise equal by
design when the same kernel (e.g. ``brg_matmul:avx512_core_amx``) computed them, so the report names it.
The harness sets ``ONEDNN_VERBOSE=1`` for CPU runs unless the user set it.
"""

from __future__ import annotations

from pathlib import Path


def onednn_kernels(stdout_log: Path, limit: int = 20) -> list[str]:
    """Unique 'primitive implementation problem' entries of executed primitives, in order of first use."""
    seen: dict[str, None] = {}
    try:
        lines = stdout_log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        if not line.startswith(("onednn_verbose", "dnnl_verbose")):
            continue
        fields = line.split(",")
        if "exec" not in fields:
            continue
        after = fields[fields.index("exec") + 1:]
        if len(after) < 3:
            continue
        _engine, primitive, implementation = after[:3]
        problem = fields[-2] if len(after) > 4 else ""  # ...,problem descriptor,time in ms
        seen.setdefault(f"{primitive} {implementation} {problem}".strip(), None)
        if len(seen) >= limit:
            break
    return list(seen)
