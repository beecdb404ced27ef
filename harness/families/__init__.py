"""Model families: one record each (``Family``), by name in ``FAMILIES``. Framework-free; a family's per-stack builder
modules (``<family>/megatron.py``, ``hf.py``, ``paddle.py``) import their framework and are imported by runners only,
through ``Family.builder(stack)``.

Adding a family: its package here (``__init__.py`` with the record as ``FAMILY``, its typed config, its parameter
layout, module outputs and gradients, ``names.toml``, one builder per stack) and its cases (docs/model-contract.md).
``FAMILIES`` finds it: every subpackage of this one is a family, DeepSeek-V3 first (``DEFAULT``), the others by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping

from harness.families.record import Family, ModelConfigError

DEFAULT = "deepseek_v3"  # the family of a config.model that names none

__all__ = ["DEFAULT", "FAMILIES", "Family", "ModelConfigError", "discover", "family_of", "model_config",
           "routed_experts"]


def discover(package: str = __name__) -> dict[str, Family]:
    """name -> record of every subpackage of `package` (its ``FAMILY``), `DEFAULT` first, the others by name. A
    subpackage without a ``FAMILY`` record, or two records of one name, is an error naming them."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{module.__name__} is a family package without a FAMILY record (a harness Family)")
        if family.name in found:
            raise ValueError(f"two families named {family.name!r}: {found[family.name].folder} and {family.folder}")
        found[family.name] = family
    return dict(sorted(found.items(), key=lambda item: item[0] != DEFAULT))


FAMILIES: dict[str, Family] = discover()


def family_of(name: str) -> Family:
    if name not in FAMILIES:
        raise ModelConfigError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def model_config(model):
    """A model's typed config: `model` itself when typed, else the wire dict (a request's or a case's resolved
    ``config.model``) read by its family's ``from_dict``."""
    if not isinstance(model, Mapping):
        return model
    return family_of(model.get("family", DEFAULT)).config.from_dict(model)


def routed_experts(model) -> int:
    """How many routed experts each MoE layer of `model` (typed or its wire dict) has: its family's answer."""
    config = model_config(model)
    return family_of(config.family).routed_experts(config)
