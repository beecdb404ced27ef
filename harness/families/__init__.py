"""Model families: one record each (``Family``), by name in ``FAMILIES``. Framework-free; a family's per-stack builder
modules (``<family>/megatron.py``, ``hf.py``, ``paddle.py``) import their framework and are imported by runners only,
through ``Family.builder(stack)``.

Adding a family: its package here (``__init__.py`` with the record, its typed config, its parameter layout, module
outputs and gradients, ``names.toml``, one builder per stack), one line in ``FAMILIES``, and its cases
(docs/model-contract.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.families import deepseek_v3, glm4_moe, minimax_m2, qwen3_moe
from harness.families.record import Family, ModelConfigError

FAMILIES: dict[str, Family] = {family.name: family for family in (deepseek_v3.FAMILY, glm4_moe.FAMILY,
                                                                   qwen3_moe.FAMILY, minimax_m2.FAMILY)}
DEFAULT = deepseek_v3.FAMILY.name  # the family of a config.model that names none

__all__ = ["DEFAULT", "FAMILIES", "Family", "ModelConfigError", "family_of", "model_config", "routed_experts"]


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
