"""What `make` and CI install, and the rule for tests that need it: off CI a missing framework skips the test; on
CI (``CI=true``, as GitHub Actions sets it) the requirements install it, so a missing or broken one fails instead
of showing as a skip."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

import pytest

# import name -> (package, the requirements file that installs it)
REQUIRED = {
    "torch": ("torch", "requirements-cpu.txt"),
    "megatron.core": ("megatron-core", "requirements-cpu.txt"),
    "paddle": ("paddlepaddle", "requirements-cpu.txt"),
    "transformers": ("transformers", "requirements-models.txt"),
    "paddleformers": ("paddleformers", "requirements-models.txt"),
    "accelerate": ("accelerate", "requirements-models.txt"),  # the HF Trainer's (harness/attach/hf.py)
}
# How a runner says a package is missing (its UNSUPPORTED reason).
MISSING_PHRASES = ("is not importable", "is not installed", "No module named")


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def require(module: str):
    """``pytest.importorskip``, except on CI, where a required module that does not import fails the test."""
    if not on_ci():
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except Exception as error:  # a broken install (a missing shared library, a bad wheel) fails too
        package, file = REQUIRED[module]
        pytest.fail(f"{module} does not import ({type(error).__name__}: {error}), but CI installs {package} "
                    f"({file}): a broken install is not a skip", pytrace=False)


def absent(*modules: str) -> bool:
    """For ``skipif``: True where a test needing `modules` may skip (one is not installed, and this is not CI)."""
    return not on_ci() and not all(_found(m) for m in modules)


def missing_required(message: str) -> str | None:
    """The required module an UNSUPPORTED reason says is missing, if it names one."""
    for module, (package, _) in REQUIRED.items():
        for name in dict.fromkeys((module, module.split(".")[0], package)):
            if re.search(rf"\b{re.escape(name)}\b[^;]*?(?:{'|'.join(MISSING_PHRASES[:2])})|No module named "
                         rf"'{re.escape(name)}", message):
                return module
    return None


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def megatron_has_dsa_switches() -> bool:
    """megatron-core >= 0.19: its DSA indexer's Hadamard rotation can be switched off (harness/runners/megatron/
    dsa.py)."""
    if absent("megatron.core"):
        return False
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import TransformerConfig

    return "dsa_indexer_rotate_activation" in {f.name for f in fields(TransformerConfig)}


def megatron_builds_gdn() -> bool:
    """megatron-core >= 0.19's GatedDeltaNet with flash-linear-attention importable (harness/runners/megatron/gdn.py):
    on the GPU machine, or here with 0.19.2's pure-Python files and fla (and triton) on PYTHONPATH."""
    if absent("megatron.core"):
        return False
    try:
        from megatron.core.ssm.gated_delta_net import common
    except ImportError:
        return False
    return common.HAVE_FLA
