"""flash-linear-attention's refusal of the Triton on a Hopper GPU, as UNSUPPORTED naming what is missing.

fla (the Gated DeltaNet kernels transformers takes for Qwen3.5-MoE when fla is installed) raises a plain
``RuntimeError`` in its gated backward (``chunk_bwd_dqkwg``) on a Hopper GPU with a Triton it knows computes wrong
results there, and asks for a fixed Triton or its TileLang backend (fla 0.6.0 on an H100 with triton 3.6.0, 2026-12-06,
docs/model.md "Qwen3.5-MoE"). That is a package missing, so UNSUPPORTED, naming it; any other exception stays what it
is (ERROR). Standard library only: the message is matched, never the GPU.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from contextlib import contextmanager

from harness.run.protocol import Unsupported

# fla's own words: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg
# (see #640). Please upgrade Triton to >= 3.7.1 or install tilelang: `pip install tilelang`"; earlier fla releases
# gave no fixed Triton ("Triton >= 3.4.0 on Hopper GPUs ... (see #640). Please install tilelang: ...").
HOPPER_TRITON = re.compile(
    r"^Triton >= [\d.]+(?: and < (?P<fixed>[\d.]+))? on Hopper GPUs produces incorrect results for (?P<kernel>[\w ]+) "
    r"\(see #\d+\)\. Please (?:upgrade Triton to >= (?P=fixed) or )?install tilelang\b")


def missing_package(error: BaseException) -> str | None:
    """The UNSUPPORTED reason when `error` is fla refusing the Triton on Hopper, else None."""
    text = str(error).strip()
    match = HOPPER_TRITON.match(text) if type(error) is RuntimeError else None
    if match is None:
        return None
    needed = f"Triton >= {match['fixed']} or tilelang" if match["fixed"] else "tilelang"
    return (f"flash-linear-attention needs {needed} for {match['kernel']} on a Hopper GPU (installed here: "
            f"{_installed('triton')}, {_installed('tilelang')}); fla refused: {text}")


@contextmanager
def refusal_as_unsupported() -> Iterator[None]:
    """Around a cell of the HF model runner: fla's Hopper refusal becomes Unsupported; every other exception passes."""
    try:
        yield
    except RuntimeError as error:
        reason = missing_package(error)
        if reason is None:
            raise
        raise Unsupported(reason) from error


def _installed(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} not installed"
