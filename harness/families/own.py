"""A model the harness has no family record of (docs/attach.md, "Any model"): recorded in its own parameter names,
or in the names of a small map file the user gives, so that two runs of one stack compare with no map at all and a
torch run and a Paddle run of the same model compare in one set of names.

``config.model`` of such a run is ``{"family": "own", "parameters": [[name, shape], ...]}``: the canonical trained
parameters and their shapes, in natural order (what ``OwnModel.record`` gives the step files' layout from, as a
family's record does). ``own_names`` makes it from the model's parameters and the map file. The map file (TOML) has a
section per stack, ``[torch]`` or ``[paddle]``, each with the tables of a family's ``names.toml``:

    [paddle.grads]                       # canonical parameter = this stack's parameter (or a rule on it)
    "mlp.up.weight" = { transpose = "ffn.fc_in.weight" }
    "layers.{L}.norm.weight" = "blocks.{L}.ln.weight"
    [paddle.modules]                     # canonical module = this stack's module (modules_at)
    "mlp.up" = "ffn.fc_in"

With a map, the canonical names are its ``grads`` entries, every one of which must read parameters the model has, and
every trained parameter must be read by one (the recorder refuses otherwise: nothing is dropped silently). Standard
library only, as ``harness.families.names``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

from harness.families.config import ModelConfigError

OWN = "own"  # config.model's family of a model the harness has no record of
SECTIONS = {"hf": "torch", "paddle": "paddle"}  # a recorder's stack -> its section of the user's map file
TABLES = ("grads", "modules")
RULES = {"grads": ("same", "transpose"), "modules": ("same", "output_of", "input_of", "not_captured")}


@dataclass(frozen=True)
class OwnModel:
    """The typed config of a model without a family record: its canonical trained parameters."""

    parameters: tuple[tuple[str, tuple[int, ...]], ...]
    family = OWN

    @property
    def record(self) -> OwnModel:
        """What a family's record answers for the step files' layout (``harness.case.ops``), answered here."""
        return self

    def gradients(self, config=None) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"grad.{name}", shape) for name, shape in self.parameters]

    def buffers(self, config=None) -> list:
        return []  # no routing biases: a model of its own has no buffer the harness knows training changes

    def to_dict(self) -> dict:
        return {"parameters": [[name, list(shape)] for name, shape in self.parameters], "family": OWN}

    @classmethod
    def from_dict(cls, wire: dict) -> OwnModel:
        unknown = sorted(set(wire) - {"family", "parameters"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r} of a model of its own; known: family, parameters")
        listed = wire.get("parameters")
        if not isinstance(listed, list) or not all(
                isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(isinstance(d, int) for d in entry[1]) for entry in listed):
            raise ModelConfigError(f"parameters must be a list of [name, shape] (got {listed!r})")
        return cls(tuple((name, tuple(shape)) for name, shape in listed))


def natural(name: str) -> tuple:
    """Sort key putting layers.2 before layers.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


class OwnNames:
    """One stack's names of a model of its own: `tables` {"grads": {canonical: raw rule}, "modules": {...}} in
    concrete names (no map: empty, every name its own)."""

    def __init__(self, stack: str, path: Path | None, tables: dict[str, dict]):
        self.stack, self.path, self.tables = stack, path, tables

    @classmethod
    def read(cls, path, stack: str, parameters: dict[str, tuple], modules: list[str]) -> OwnNames:
        """`stack`'s section of the map file at `path` (None: no map), its patterns expanded over the model's
        `parameters` ({name: shape}) and `modules` (names); ModelConfigError naming the file, field and value."""
        if path is None:
            return cls(stack, None, {"grads": {}, "modules": {}})
        path = Path(path)
        section = SECTIONS[stack]
        try:
            document = tomllib.loads(path.read_text())
        except OSError as error:
            raise ModelConfigError(f"name map {path}: not readable ({error})") from None
        except tomllib.TOMLDecodeError as error:
            raise ModelConfigError(f"name map {path}: not TOML ({error})") from None
        if section not in document or not isinstance(document[section], dict):
            raise ModelConfigError(f"name map {path}: no section [{section}] (sections: "
                                   f"{', '.join(document) or 'none'}): the {section} recorder reads that one")
        unknown = sorted(set(document[section]) - set(TABLES))
        if unknown:
            raise ModelConfigError(f"name map {path}: [{section}.{unknown[0]}]: no such table (tables: "
                                   f"{', '.join(TABLES)})")
        if not document[section].get("grads"):
            raise ModelConfigError(f"name map {path}: [{section}.grads] is missing or empty: it names the trained "
                                   "parameters")
        held = {"grads": set(parameters), "modules": set(modules)}
        tables = {table: _expand(path, f"{section}.{table}", document[section].get(table, {}), table, held[table])
                  for table in TABLES}
        return cls(stack, path, tables)

    def canonical(self, parameters: dict[str, tuple]) -> OwnModel:
        """The model's canonical parameters and shapes (every parameter under its own name where there is no map)."""
        if self.path is None:
            return OwnModel(tuple(sorted(parameters.items(), key=lambda item: natural(item[0]))))
        shapes = {}
        for name, (kind, source) in self.tables["grads"].items():
            shape = parameters[source]
            shapes[name] = (*shape[:-2], shape[-1], shape[-2]) if kind == "transpose" else shape
        return OwnModel(tuple(sorted(shapes.items(), key=lambda item: natural(item[0]))))

    def name_map(self):
        """The tables as a ``NameMap`` (what the recorders and the capture read rules from)."""
        from harness.families.names import NameMap

        raw = {table: {name: {kind: source} for name, (kind, source) in entries.items()}
               for table, entries in self.tables.items()}
        return NameMap(OWN, SECTIONS[self.stack], raw)

    def modules(self, modules: list[str]) -> list[str]:
        """The canonical modules to capture: the map's, else every module under its own name."""
        return list(self.tables["modules"]) if self.path is not None and self.tables["modules"] else list(modules)


def _expand(path: Path, field: str, table, kind_of: str, held: set[str]) -> dict[str, tuple[str, str]]:
    """{canonical name: (rule kind, the model's name)} of one table, a pattern's {L} / {E} filled from the model's
    names its source matches; ModelConfigError naming the file, the field and the value."""
    from harness.families.names import _fill, _pattern

    if not isinstance(table, dict):
        raise ModelConfigError(f"name map {path}: [{field}] must be a table (got {table!r})")
    expanded: dict[str, tuple[str, str]] = {}
    for pattern, raw in table.items():
        raw = {"same": raw} if isinstance(raw, str) else raw
        allowed = RULES[kind_of]
        forms = ", ".join(f"{{{kind} = NAME}}" for kind in allowed)
        if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in allowed \
                or not isinstance(next(iter(raw.values())), str):
            raise ModelConfigError(f"name map {path}: [{field}] {pattern!r} = {raw!r}: a rule here is a name or one "
                                   f"of {forms}")
        kind, source = next(iter(raw.items()))
        if kind == "not_captured":
            expanded[pattern] = (kind, source)
            continue
        matched = [match.groupdict() for name in sorted(held, key=natural)
                   if (match := _pattern(source).fullmatch(name))]
        if not matched:
            raise ModelConfigError(f"name map {path}: [{field}] {pattern!r} = {source!r}: the model has no "
                                   f"{'parameter' if kind_of == 'grads' else 'module'} {source!r}")
        for values in matched:
            name = _fill(pattern, values)
            if name in expanded:
                raise ModelConfigError(f"name map {path}: [{field}] {pattern!r}: canonical name {name!r} made twice")
            expanded[name] = (kind, _fill(source, values))
    return expanded
