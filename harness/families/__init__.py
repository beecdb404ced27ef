"""Model families, as data: one folder each (``family.toml``: the typed config, the architecture; ``names.toml``: the
names per stack; ``<stack>.toml``: what one framework's builder reads of it), read into one ``Family`` record each,
by name in ``FAMILIES``. Framework-free: each framework builds every family in its own room
(harness/runners/megatron/families.py, harness/runners/torch/hf_families.py, harness/runners/paddle/families.py).

Adding a family: its folder here and its cases (docs/model-contract.md). ``FAMILIES`` finds it: every subfolder with a
``family.toml`` is a family, DeepSeek-V3 first (``DEFAULT``), the others by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from harness.families.architecture import Architecture
from harness.families.config import FamilyConfig, ModelConfigError
from harness.families.own import OWN, OwnModel
from harness.families.record import Family, FamilyFileError

DEFAULT = "deepseek_v3"  # the family of a config.model that names none

__all__ = ["DEFAULT", "FAMILIES", "Architecture", "Family", "FamilyConfig", "FamilyFileError", "ModelConfigError",
           "discover", "family_of", "model_config", "routed_experts"]


HERE = Path(__file__).resolve().parent


def discover(folder: Path = HERE) -> dict[str, Family]:
    """name -> record of every subfolder of `folder` with a ``family.toml``, `DEFAULT` first, the others by name. Two
    records of one name are an error naming both folders."""
    found: dict[str, Family] = {}
    for sub in sorted(p for p in folder.iterdir() if (p / "family.toml").is_file()):
        family = Family.load(sub)
        if family.name in found:
            raise FamilyFileError(f"two families named {family.name!r}: {found[family.name].folder} and {sub}")
        found[family.name] = family
    return dict(sorted(found.items(), key=lambda item: item[0] != DEFAULT))


FAMILIES: dict[str, Family] = discover()


def family_of(name: str) -> Family:
    if name not in FAMILIES:
        raise ModelConfigError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def model_config(model) -> FamilyConfig:
    """A model's typed config: `model` itself when typed, else the wire dict (a request's or a case's resolved
    ``config.model``) read by its family's ``from_dict``."""
    if not isinstance(model, Mapping):
        return model
    if model.get("family") == OWN:  # a model the harness has no record of (harness.families.own)
        return OwnModel.from_dict(model)
    return family_of(model.get("family", DEFAULT)).config.from_dict(model)


def routed_experts(model) -> int:
    """How many routed experts each MoE layer of `model` (typed or its wire dict) has: its family's answer."""
    config = model_config(model)
    return family_of(config.family).routed_experts(config)
