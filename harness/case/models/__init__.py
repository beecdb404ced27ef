"""Model families for the model-level cases (``op = "causal_lm"``): config defaults and name maps.

Framework-free (standard library only), so the harness, every runner and the capture API can import it.

- ``resolve_config(family, given)``: the model config with every default resolved (Kimi-K2's values), in HF
  ``DeepseekV3Config`` key names; the case stores the result, so a runner never falls back on its library's
  own defaults.
- ``NameMap.load(family, framework)``: one framework's section of ``<family>.toml`` (see that file's header
  for the format), with ``{L}`` (a layer) and ``{E}`` (an expert) placeholders matched against concrete names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

FOLDER = Path(__file__).resolve().parent
FAMILIES = ("deepseek_v3",)

# Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json), the DeepSeek-V3 architecture. Widths are the case's business;
# these fill what a case leaves out.
KIMI_K2 = {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu",
    # DeepSeek-V3 checkpoints store the rope dims of q_b_proj / kv_a_proj_with_mqa interleaved (pairs); every
    # implementation de-interleaves them before rotating (HF: rope_interleave=True; Megatron MLA: its mla rope path).
    "rope_interleave": True,
}
DEFAULTS = {"deepseek_v3": KIMI_K2}
FIXED = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "tie_word_embeddings": (False,),
         "attention_bias": (False,), "hidden_act": ("silu",), "n_group": (1,), "topk_group": (1,)}


class ModelConfigError(ValueError):
    """A model config key or value the harness cannot use; the message names the key and value."""


def resolve_config(family: str, given: dict) -> dict:
    """Every key of the family's defaults, the case's values over them (rope_scaling merged key by key)."""
    if family not in DEFAULTS:
        raise ModelConfigError(f"unknown model family {family!r} (known: {', '.join(FAMILIES)})")
    defaults = DEFAULTS[family]
    unknown = sorted(set(given) - set(defaults) - {"family"})
    if unknown:
        raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(defaults))}")
    resolved = {**defaults, **{k: v for k, v in given.items() if k != "family"}}
    resolved["rope_scaling"] = {**defaults["rope_scaling"], **given.get("rope_scaling", {})}
    for key, value in resolved.items():
        default = defaults[key]
        if key == "rope_theta" and isinstance(value, int) and not isinstance(value, bool):
            resolved[key] = value = float(value)
        if type(value) is not type(default) and not (isinstance(default, float) and type(value) is int):
            raise ModelConfigError(f"{key} must be {type(default).__name__} (got {value!r})")
        if key in FIXED and value not in FIXED[key]:
            raise ModelConfigError(f"{key} must be one of {FIXED[key]} (the harness models only these) (got {value!r})")
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and key != "first_k_dense_replace":
            raise ModelConfigError(f"{key} must be > 0 (got {value!r})")
    if resolved["num_key_value_heads"] != resolved["num_attention_heads"]:
        raise ModelConfigError("num_key_value_heads must equal num_attention_heads (MLA)")
    if not 0 <= resolved["first_k_dense_replace"] <= resolved["num_hidden_layers"]:
        raise ModelConfigError(f"first_k_dense_replace must be in 0..num_hidden_layers "
                               f"(got {resolved['first_k_dense_replace']!r})")
    if resolved["num_experts_per_tok"] > resolved["n_routed_experts"]:
        raise ModelConfigError("num_experts_per_tok must be <= n_routed_experts")
    resolved["family"] = family
    return resolved


def dense_layers(config: dict) -> list[int]:
    return list(range(min(config["first_k_dense_replace"], config["num_hidden_layers"])))


def moe_layers(config: dict) -> list[int]:
    return list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))


# --- name maps ----------------------------------------------------------------------------------------------------

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
        path = Path(path or FOLDER / f"{family}.toml")
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

    def rule(self, section: str, name: str, config: dict | None = None) -> Rule:
        """The rule for a concrete target `name` (a pattern that matches it, placeholders filled in), else same."""
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
            experts = int((config or {}).get("n_routed_experts", 0)) if kind.startswith("stack") else 0
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
