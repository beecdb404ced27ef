"""Every family's typed config, made from its ``family.toml``: a frozen dataclass of the HF config keys with the real
model's values as defaults (``[config]``), the values the harness models only (``[fixed]``) and the relations between
keys (``[[check]]``). Written once here; a family brings data only.

``resolve(given)`` is what a case's ``config.model`` becomes: every default filled (a runner never falls back on its
library's own), every value of its default's type, errors naming the key and value. ``to_dict()`` is the wire form a
request and a report carry (``family`` last, a list where the config holds a tuple); ``from_dict`` reads it back and
refuses unknown keys, nothing else (a request was checked when its case loaded).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any, ClassVar

from harness.families.expressions import evaluate


class ModelConfigError(ValueError):
    """A model config key or value the harness cannot use; the message names the key and value."""


@dataclass(frozen=True)
class ConfigRules:
    """What a family's ``family.toml`` says of its config beyond the defaults."""

    fixed: dict[str, tuple] = field(default_factory=dict)  # key -> the values the harness models
    may_be_zero: tuple[str, ...] = ()  # numeric keys that may be 0 (every other number must be > 0)
    # (expression that must hold, error with {key} placeholders, a config it refuses: every check can fail)
    checks: tuple[tuple[str, str, dict], ...] = ()


class FamilyConfig:
    """The base of every family's config class (``make_config``); the fields are the family's HF keys."""

    family: ClassVar[str]
    rules: ClassVar[ConfigRules]
    record: ClassVar[Any]  # its Family (harness.families.record), set when the family is loaded

    @classmethod
    def resolve(cls, given: dict) -> FamilyConfig:
        """A case's ``config.model`` with every default filled (a table merged key by key), checked."""
        defaults = cls().to_dict()
        del defaults["family"]
        unknown = sorted(set(given) - set(defaults) - {"family"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(defaults))}")
        resolved = {**defaults, **{k: v for k, v in given.items() if k != "family"}}
        for key, default in defaults.items():
            resolved[key] = _typed(key, resolved[key], default)
            if key in cls.rules.fixed and resolved[key] not in cls.rules.fixed[key]:
                raise ModelConfigError(f"{key} must be one of {cls.rules.fixed[key]} (the harness models only these) "
                                       f"(got {resolved[key]!r})")
            if _number(resolved[key]) and resolved[key] <= 0 and key not in cls.rules.may_be_zero:
                raise ModelConfigError(f"{key} must be > 0 (got {resolved[key]!r})")
        config = cls.from_dict(resolved)
        values = config.to_dict()
        for holds, error, _ in cls.rules.checks:
            if not evaluate(holds, values):
                raise ModelConfigError(error.format(**values))
        return config

    @classmethod
    def from_dict(cls, wire: dict) -> FamilyConfig:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(wire) - set(known) - {"family"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        values = {}
        for key, value in wire.items():
            if key == "family":
                continue
            table = known[key].type if is_dataclass(known[key].type) else None  # a nested table (rope_scaling)
            values[key] = table(**value) if table and isinstance(value, dict) else \
                tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def to_dict(self) -> dict:
        return {**{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}, "family": self.family}


def make_config(family: str, class_name: str, defaults: dict, rules: ConfigRules, doc: str) -> type[FamilyConfig]:
    """The typed config class of `family`: one field per key of `defaults`, of its value's type (a list: a tuple of
    its items; a table: a frozen dataclass of its own)."""
    specs = []
    for key, value in defaults.items():
        if isinstance(value, dict):
            table = make_dataclass(f"{class_name}_{key}", [(k, type(v), v) for k, v in value.items()], frozen=True)
            specs.append((key, table, field(default_factory=table)))
        elif isinstance(value, list):
            specs.append((key, tuple, field(default=tuple(value))))
        else:
            specs.append((key, type(value), field(default=value)))
    cls = make_dataclass(class_name, specs, bases=(FamilyConfig,), frozen=True,
                         namespace={"family": family, "rules": rules, "__doc__": doc})
    return cls


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _typed(key: str, value, default):
    """`value`, of the default's type: an int where a float is expected is kept as given, rope_theta becomes a float;
    a table is merged over the default's key by key, each inner value checked; a list holds values of its default's
    items' type."""
    if key == "rope_theta" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ModelConfigError(f"{key} must be dict (got {value!r})")
        for inner, inner_value in value.items():
            if inner not in default:
                raise ModelConfigError(f"unknown key '{key}.{inner}'; known: {', '.join(sorted(default))}")
            _typed(f"{key}.{inner}", inner_value, default[inner])
        return {**default, **value}
    if isinstance(default, list):
        item = type(default[0]) if default else int
        if not isinstance(value, (list, tuple)) or not all(type(v) is item for v in value):
            raise ModelConfigError(f"{key} must be a list of {item.__name__} (got {value!r})")
        return list(value)
    if type(value) is not type(default) and not (isinstance(default, float) and type(value) is int):
        raise ModelConfigError(f"{key} must be {type(default).__name__} (got {value!r})")
    return value
