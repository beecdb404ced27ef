"""Name maps: how one framework's (or the checkpoint's) names make a family's canonical names, and the float64 floors.

``NameMap.load(family, framework)`` reads one framework's section of the family's ``names.toml`` (its header says the
format), with ``{L}`` (a layer) and ``{E}`` (an expert) placeholders matched against concrete names. Standard library
only, so the harness, every runner and the capture API can import it; the rules only name what to copy, and
``harness.capture.torch.apply_rule`` / ``harness.capture.paddle.apply_rule`` copy it (the interleave kinds through
the row orders ``interleaved_rows`` and ``part_rows`` give, computed here once).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from harness.families import ModelConfigError, family_of, model_config, routed_experts

SECTIONS = ("checkpoint", "grads", "modules", "float64", "float64_update")
FLOORS = ("float64", "float64_update")  # tables of float64 floors: pattern -> relative error (no rules)
KINDS = ("same", "cat0", "cat_last", "slice", "stack_cat0", "stack", "transpose", "transpose_cat0", "cat0_transpose",
         "interleave", "transpose_interleave", "deinterleave", "transpose_deinterleave", "input_of", "output_of",
         "tokens_of", "not_captured")
GROUPED = ("interleave", "transpose_interleave", "deinterleave", "transpose_deinterleave")  # need Family.interleave


@dataclass(frozen=True)
class Rule:
    """How one target name is made from a framework's (or the checkpoint's) names.

    kind: same | transpose | slice (sources[0][index]) | cat0 | cat_last | stack (over experts) | stack_cat0
    (stack over experts of cat0 of the sources) | transpose_cat0 (each transposed, then cat0) | cat0_transpose
    (cat0, then transposed: Paddle's fused up_gate_proj [in, 2F] from gate and up) | interleave (the sources cut
    into `groups` equal chunks each and laid out group by group: Megatron's linear_qkv and Paddle's qkv_proj) |
    deinterleave (part `index` of such a tensor) | transpose_interleave / transpose_deinterleave (the same on
    Paddle's [in, out] weights) | input_of / output_of (module hooks) | tokens_of (a module's output with every dim
    but the last flattened into tokens: transformers 5.23.0's MLA views its latent as one head, [B, 1, S, r]) |
    not_captured (why). Parameters and gradients
    interleave along dim 0, module outputs along the last dim.
    """

    kind: str
    sources: tuple[str, ...] = ()
    index: int | None = None
    why: str = ""
    experts: int = 0  # stack kinds: how many experts ({E} = 0 .. experts-1)
    groups: int = 0  # interleave kinds: how many groups (the key/value heads)
    widths: tuple[int, ...] = ()  # interleave kinds: each part's width per group (q: heads/groups x head_dim; k; v)

    def rows(self, part: int | None = None) -> list[int]:
        """Interleave kinds: where the fused tensor's rows come from, as indices into the parts concatenated
        (``part`` None), or the fused rows that make part ``part``, in order (its de-interleave)."""
        return interleaved_rows(self.groups, self.widths) if part is None else part_rows(self.groups, self.widths,
                                                                                        part)


@dataclass
class NameMap:
    family: str
    framework: str
    tables: dict[str, dict[str, dict]] = field(default_factory=dict)  # section -> pattern -> raw rule
    notes: dict[str, str] = field(default_factory=dict)
    own_format: bool = False  # the section has a format of its own (read by its runner); only [.float64] here
    model: object = None  # the model's config (typed or a request's dict) the rules are for, unless a call names one

    @classmethod
    def load(cls, family: str, framework: str, path: Path | None = None, model=None) -> NameMap:
        """One framework's section of `family`'s name map; `model`: the config its rules are for (the stack kinds'
        expert count, the interleave kinds' groups), or None (then ``rule`` takes it per call)."""
        path = Path(path or family_of(family).names)
        document = tomllib.loads(path.read_text())
        if framework not in document:
            raise ModelConfigError(f"{path}: no section [{framework}] (sections: {', '.join(document)})")
        section = document[framework]
        if "parameters" in section:  # a format of its own ([megatron]): only its float64 floors are read here
            return cls(family, framework, {name: section.get(name, {}) for name in FLOORS}, own_format=True,
                       model=model)
        tables = {}
        for name in SECTIONS:
            table = section.get(name, {})
            for pattern, raw in table.items():
                raw = {"same": raw} if isinstance(raw, str) else raw
                if name not in FLOORS and (not isinstance(raw, dict) or len(set(raw) & set(KINDS)) != 1):
                    raise ModelConfigError(f"{path}: [{framework}.{name}] {pattern!r}: a rule is one of "
                                           f"{', '.join(KINDS)} (got {raw!r})")
            tables[name] = table
        return cls(family, framework, tables, {k: v for k, v in section.items() if isinstance(v, str)}, model=model)

    def rule(self, section: str, name: str, config=None) -> Rule:
        """The rule for a concrete target `name` (a pattern that matches it, placeholders filled in), else same.
        `config`: the model's config (typed, or a request's dict), for the expert count of the stack kinds and the
        groups of the interleave kinds; default: the one the map was loaded for."""
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
            config = self.model if config is None else config
            experts = routed_experts(config) if kind.startswith("stack") and config is not None else 0
            if kind in GROUPED:
                groups, widths = grouping(self.family, config, f"{self.framework}.{section} {pattern!r}")
                return Rule(kind, sources, index, experts=experts, groups=groups, widths=widths)
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


def grouping(family: str, config, where: str) -> tuple[int, tuple[int, ...]]:
    """(groups, per-group widths) of the interleave kinds for `config`: the family's answer (``Family.interleave``)."""
    grouped = None if config is None else family_of(family).interleave(model_config(config))
    if grouped is None:
        raise ModelConfigError(f"[{where}]: an interleave rule needs the model's config and a family that says how "
                               f"it groups ({family}: {'no Family.interleave' if config is not None else 'no config'})")
    groups, widths = grouped
    return int(groups), tuple(int(w) for w in widths)


def interleaved_rows(groups: int, widths: tuple[int, ...]) -> list[int]:
    """The fused tensor's rows as indices into its parts concatenated (part i: `groups` x widths[i] rows): group by
    group, each part's chunk of that group. Megatron's linear_qkv (Megatron Bridge's merge_qkv_weights) and Paddle's
    qkv_proj lay q, k and v out so, one chunk per key/value head."""
    starts = [sum(groups * w for w in widths[:i]) for i in range(len(widths))]
    return [starts[i] + g * w + r for g in range(groups) for i, w in enumerate(widths) for r in range(w)]


def part_rows(groups: int, widths: tuple[int, ...], part: int) -> list[int]:
    """The fused rows that make part `part` (its de-interleave), in order."""
    stride, offset = sum(widths), sum(widths[:part])
    return [g * stride + offset + r for g in range(groups) for r in range(widths[part])]


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
