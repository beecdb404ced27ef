"""Name maps: how one framework's (or the checkpoint's) names make a family's canonical names, and the float64 floors.

``NameMap.load(family, framework)`` reads one framework's section of the family's ``names.toml`` (its header says the
format), with ``{L}`` (a layer) and ``{E}`` (an expert) placeholders matched against concrete names. Standard library
only, so the harness, every runner and the capture API can import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from harness.families import ModelConfigError, family_of, routed_experts

SECTIONS = ("checkpoint", "grads", "modules", "float64", "float64_update")
FLOORS = ("float64", "float64_update")  # tables of float64 floors: pattern -> relative error (no rules)
KINDS = ("same", "cat0", "cat_last", "slice", "stack_cat0", "stack", "transpose", "transpose_cat0", "input_of",
         "output_of", "not_captured")


@dataclass(frozen=True)
class Rule:
    """How one target name is made from a framework's (or the checkpoint's) names.

    kind: same | transpose | slice (sources[0][index]) | cat0 | cat_last | stack (over experts) | stack_cat0
    (stack over experts of cat0 of the sources) | input_of / output_of (module hooks) | not_captured (why).
    """

    kind: str
    sources: tuple[str, ...] = ()
    index: int | None = None
    why: str = ""
    experts: int = 0  # stack kinds: how many experts ({E} = 0 .. experts-1)


@dataclass
class NameMap:
    family: str
    framework: str
    tables: dict[str, dict[str, dict]] = field(default_factory=dict)  # section -> pattern -> raw rule
    notes: dict[str, str] = field(default_factory=dict)
    own_format: bool = False  # the section has a format of its own (read by its runner); only [.float64] here

    @classmethod
    def load(cls, family: str, framework: str, path: Path | None = None) -> NameMap:
        path = Path(path or family_of(family).names)
        document = tomllib.loads(path.read_text())
        if framework not in document:
            raise ModelConfigError(f"{path}: no section [{framework}] (sections: {', '.join(document)})")
        section = document[framework]
        if "parameters" in section:  # a format of its own ([megatron]): only its float64 floors are read here
            return cls(family, framework, {name: section.get(name, {}) for name in FLOORS}, own_format=True)
        tables = {}
        for name in SECTIONS:
            table = section.get(name, {})
            for pattern, raw in table.items():
                raw = {"same": raw} if isinstance(raw, str) else raw
                if name not in FLOORS and (not isinstance(raw, dict) or len(set(raw) & set(KINDS)) != 1):
                    raise ModelConfigError(f"{path}: [{framework}.{name}] {pattern!r}: a rule is one of "
                                           f"{', '.join(KINDS)} (got {raw!r})")
            tables[name] = table
        return cls(family, framework, tables, {k: v for k, v in section.items() if isinstance(v, str)})

    def rule(self, section: str, name: str, config=None) -> Rule:
        """The rule for a concrete target `name` (a pattern that matches it, placeholders filled in), else same.
        `config`: the model's config (typed, or a request's dict), for the expert count of the stack kinds."""
        if self.own_format:
            raise ModelConfigError(f"[{self.framework}] of the {self.family} name map has a format of its own, read "
                                   "by its runner; NameMap reads only its float64 floors")
        for pattern, raw in self.tables.get(section, {}).items():
            match = _pattern(pattern).fullmatch(name)
            if match is None:
                continue
            values = match.groupdict()
            raw = {"same": raw} if isinstance(raw, str) else raw
            kind = next(k for k in raw if k in KINDS)
            value = raw[kind]
            if kind == "not_captured":
                return Rule(kind, why=value)
            sources = tuple(_fill(s, values) for s in ([value] if isinstance(value, str) else value))
            index = int(_fill(str(raw["index"]), values)) if "index" in raw else None
            experts = routed_experts(config) if kind.startswith("stack") and config is not None else 0
            return Rule(kind, sources, index, experts=experts)
        return Rule("same", (name,))

    def float64_floor(self, tensor: str, default: float, table: str = "float64") -> float:
        """The relative error this framework cannot go below in float64 on `tensor` (see [<fw>.float64]; a training
        step's optimizer run on side a's gradients: [<fw>.float64_update])."""
        for pattern, floor in self.tables.get(table, {}).items():
            if _pattern(pattern).fullmatch(tensor):
                return float(floor)
        return default


def lookup(table: dict[str, str], name: str) -> str | None:
    """The value for a concrete `name` in a table keyed by names or name patterns ({L}, {E}, *): e.g. a runner's
    ``not_captured``."""
    if name in table:
        return table[name]
    return next((value for key, value in table.items() if _pattern(key).fullmatch(name)), None)


def expand_stack(rule: Rule) -> list[list[str]]:
    """Per expert, the source names of a stack rule."""
    return [[s.replace("{E}", str(e)) for s in rule.sources] for e in range(rule.experts)]


_PATTERNS: dict[str, re.Pattern] = {}


def _pattern(pattern: str) -> re.Pattern:
    if pattern not in _PATTERNS:
        text = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        text = text.replace(r"\*", r".*")
        _PATTERNS[pattern] = re.compile(text)
    return _PATTERNS[pattern]


def _fill(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template
