"""The ``Family`` record type: what the harness asks of a model family, and nothing family-specific itself."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.case.specs import TensorSpec

STACKS = ("megatron", "hf", "paddle")  # one builder module per stack: harness/families/<family>/<stack>.py
# What the runners ask of a family's builder for each stack (harness/families/deepseek_v3/<stack>.py and
# glm4_moe/<stack>.py say what each is).
BUILDER_API = {
    "megatron": ("IMPLEMENTATION", "ADAPTERS", "install_adapters", "layer_spec", "gpt_model_kwargs",
                 "translate_config"),
    "hf": ("MODEL", "KNOBS", "modeling", "build", "rotary", "record_routing", "float64_mode"),
    "paddle": ("MODEL", "KNOBS", "adapters", "classes", "config_kwargs", "record_routing",
               "canonical_modules", "canonical_grads", "explain", "fleet_model"),
}


class ModelConfigError(ValueError):
    """A model config key or value the harness cannot use; the message names the key and value."""


def resolve_keys(given: dict, defaults: dict, fixed: dict, typed=None) -> dict:
    """A case's ``config.model`` over a family's `defaults` (its HF keys; ``family`` aside): an unknown key refused,
    each value of its default's type (`typed(key, value, default)`, ``typed_value`` unless given), a key in `fixed`
    one of the values the harness models, a number > 0. The family's config checks what relates keys."""
    typed = typed or typed_value
    unknown = sorted(set(given) - set(defaults) - {"family"})
    if unknown:
        raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(defaults))}")
    resolved = {**defaults, **{k: v for k, v in given.items() if k != "family"}}
    for key, value in resolved.items():
        value = resolved[key] = typed(key, value, defaults[key])
        if key in fixed and value not in fixed[key]:
            raise ModelConfigError(f"{key} must be one of {fixed[key]} (the harness models only these) "
                                   f"(got {value!r})")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise ModelConfigError(f"{key} must be > 0 (got {value!r})")
    return resolved


def typed_value(key: str, value, default):
    """`value`, of the default's type (an int where a float is expected is kept as given; rope_theta becomes a
    float)."""
    if key == "rope_theta" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(default) and not (isinstance(default, float) and type(value) is int):
        raise ModelConfigError(f"{key} must be {type(default).__name__} (got {value!r})")
    return value


@dataclass(frozen=True, eq=False)  # eq=False: one record per family, compared by identity
class Family:
    """One model family (like an ``Op`` record one floor up). Every callable takes the family's typed config.

    `config` is the typed config class: ``resolve(given)`` (a case's ``config.model``: defaults filled, validated,
    errors naming key and value), ``from_dict(wire)`` (a request's resolved ``config.model``) and ``to_dict()`` (the
    wire dict, with ``family``). Canonical names are HF checkpoint names (docs/model-contract.md)."""

    name: str
    config: type
    folder: Path  # names.toml (the name maps and float64 floors) and the builder modules
    # (HF checkpoint name, shape, kind) of every parameter and buffer, in forward order; kinds are the family's, but
    # "norm" (weights near 1) and "buffer" (not trained, float32 or wider: a routing bias) are read by the harness
    parameters: Callable[[Any], list[tuple[str, tuple[int, ...], str]]]
    gradients: Callable[[Any], list[tuple[str, tuple[int, ...]]]]  # "grad.<name>", shape, in backward order
    modules: Callable[[Any, int], list[TensorSpec]]  # module outputs at a token count, in forward order
    dense_layers: Callable[[Any], list[int]]
    moe_layers: Callable[[Any], list[int]]
    routed_experts: Callable[[Any], int]  # per MoE layer (0: a dense model)
    # Checkpoint name suffixes whose first dim counts the routed experts: sliced when a real checkpoint has more
    sliced_by_expert: tuple[str, ...] = ()
    # (groups, per-group widths of the parts) for the name maps' interleave rules (harness.families.names): a stack
    # that fuses q, k and v into one tensor per key/value head (Megatron's linear_qkv, Paddle's qkv_proj) gets
    # (num_key_value_heads, (heads / groups x head_dim, head_dim, head_dim)); None: the family fuses nothing so
    interleave: Callable[[Any], tuple[int, tuple[int, ...]]] | None = None

    @property
    def names(self) -> Path:
        return self.folder / "names.toml"

    def buffers(self, config) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the buffers: in the checkpoint and the state a training step may change, never trained."""
        return [(name, shape) for name, shape, kind in self.parameters(config) if kind == "buffer"]

    def builder(self, stack: str) -> ModuleType:
        """The module that builds this family in one stack (it imports that stack's framework: runners only)."""
        if stack not in STACKS:
            raise ValueError(f"no stack {stack!r} (stacks: {', '.join(STACKS)})")
        return importlib.import_module(f"harness.families.{self.name}.{stack}")
