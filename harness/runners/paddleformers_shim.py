"""Import shim for ``paddlefleet_ops``, the GPU-only package PaddleFormers imports at module level.

``paddleformers/transformers/fused_a2a.py`` (1.2.0) runs ``from paddlefleet_ops import is_deep_ep_available`` on
import, so ``paddleformers.transformers.deepseek_v3`` cannot be imported without it; the package is not on PyPI and
has no CPU build. Where the real package imports, it is used and nothing is installed. Otherwise a stand-in module
answers ``is_deep_ep_available() -> False`` (DeepEP, its all-to-all kernels, are GPU-only) and nothing else;
``fp8_utils.py`` wraps ``from paddlefleet_ops import deep_gemm`` in try/except and falls back by itself.

Temporary: the ``paddle-model`` work builds the shared shim for the whole-model runner; once it is on main this
module should re-export theirs.
"""

from __future__ import annotations

import importlib
import sys
import types

SHIM_NAME = "paddlefleet_ops"


def install() -> str:
    """Make ``import paddlefleet_ops`` work; returns what was used ("real" or "shim")."""
    existing = sys.modules.get(SHIM_NAME)
    if existing is not None:
        return "shim" if getattr(existing, "__harness_shim__", False) else "real"
    try:
        importlib.import_module(SHIM_NAME)
        return "real"
    except ImportError:
        pass
    shim = types.ModuleType(SHIM_NAME)
    shim.__harness_shim__ = True
    shim.__doc__ = "bitwise-harness stand-in: the real paddlefleet_ops is GPU-only; DeepEP is not available"
    shim.is_deep_ep_available = lambda: False
    sys.modules[SHIM_NAME] = shim
    return "shim"
