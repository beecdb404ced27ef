"""A stand-in for PaddleFleet's GPU-only ``paddlefleet_ops`` package, so that PaddleFormers imports on a CPU.

PaddleFormers 1.2.0 imports ``paddlefleet_ops`` unconditionally at import time
(``paddleformers/transformers/fused_a2a.py``: ``from paddlefleet_ops import is_deep_ep_available``), although only
its expert-parallel all-to-all (DeepEP) uses it. ``paddlefleet_ops`` is a CUDA package on Paddle's own index, not
on PyPI. The stand-in provides only ``is_deep_ep_available() -> False`` ("DeepEP not available", which makes
``fused_a2a`` set ``HAVE_DEEP_EP = False`` and never touch DeepEP) and nothing else: any other attribute raises, and
every access is logged, so a test can show that the model's computation never reaches it.

It is installed only when the real package is missing (``importlib.util.find_spec``); the runner names it in
``meta.json`` ``adapters`` with ``changes_computation: false``.
"""

from __future__ import annotations

import importlib.util
import sys
import types

MODULE = "paddlefleet_ops"
ADAPTER = {
    "name": "paddlefleet_ops stand-in (harness.runners.paddle.paddlefleet_ops_shim)",
    "why": "paddleformers/transformers/fused_a2a.py imports is_deep_ep_available from paddlefleet_ops, PaddleFleet's "
           "GPU-only package (not on PyPI); the stand-in answers is_deep_ep_available() -> False and provides "
           "nothing else, so DeepEP (expert-parallel all-to-all, unused at EP=1) stays off",
    "changes_computation": False,
}


class StandIn(types.ModuleType):
    """Only ``is_deep_ep_available``; every attribute looked up is recorded in ``accesses``."""

    def __init__(self):
        super().__init__(MODULE, "harness stand-in for the GPU-only paddlefleet_ops (not the real package)")
        self.__dict__["accesses"] = []
        self.__dict__["__harness_stand_in__"] = True

    def __getattribute__(self, name):
        if not name.startswith("__") and name != "accesses":
            object.__getattribute__(self, "accesses").append(name)
        return super().__getattribute__(name)

    def __getattr__(self, name):  # only reached for names the stand-in does not define
        raise AttributeError(f"{MODULE} stand-in (harness) provides only is_deep_ep_available; {name!r} was asked "
                             "for: the real paddlefleet_ops is needed for this path")

    @staticmethod
    def is_deep_ep_available() -> bool:
        return False


def real_package_present() -> bool:
    module = sys.modules.get(MODULE)
    if module is not None:
        return not getattr(module, "__harness_stand_in__", False)
    return importlib.util.find_spec(MODULE) is not None


def install() -> dict | None:
    """Put the stand-in in ``sys.modules`` if the real package is missing; return the adapter record, else None."""
    if real_package_present():
        return None
    module = sys.modules.get(MODULE)
    if module is None:
        module = sys.modules[MODULE] = StandIn()
    return ADAPTER


def accesses() -> list[str]:
    """Attribute names looked up on the stand-in so far ([] when the real package is in use)."""
    module = sys.modules.get(MODULE)
    return list(module.accesses) if getattr(module, "__harness_stand_in__", False) else []
