"""The ``Family`` record: what the harness asks of a model family, read from the family's folder (``family.toml``:
its config, its architecture; ``names.toml``: its names per stack; ``<stack>.toml``: what one framework's builder
needs to know of it). Nothing family-specific is written here, and nothing imports a framework."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from pathlib import Path

import tomllib

from harness.case.specs import TensorSpec
from harness.families import architecture as blocks
from harness.families import layout
from harness.families.architecture import ATTENTION_KINDS, QK_NORMS, SCORINGS, Architecture, Attention, Indexer, Moe
from harness.families.config import ConfigRules, FamilyConfig, ModelConfigError, make_config
from harness.families.expressions import ExpressionError, evaluate

STACKS = ("megatron", "hf", "paddle")  # one builder per stack, in its runner's room; a <stack>.toml per family
CHOICES = {"attention.kind": ATTENTION_KINDS, "attention.qk_norm": QK_NORMS, "moe.scoring": SCORINGS}


class FamilyFileError(ValueError):
    """A family's TOML file the harness cannot read; the message names the file, the field and the value."""


@dataclass(frozen=True, eq=False)  # eq=False: one record per family, compared by identity
class Family:
    """One model family (like an ``Op`` record one floor up), read from its folder by ``Family.load``. Every method
    takes the family's typed config (``config``: ``resolve``, ``from_dict``, ``to_dict``). Canonical names are HF
    checkpoint names (docs/model-contract.md)."""

    name: str
    config: type[FamilyConfig]
    folder: Path  # family.toml, names.toml (the name maps and float64 floors), <stack>.toml
    about: str  # what the family is, and where its values come from
    # how each Architecture field is read from the config: expressions over its keys (family.toml [architecture])
    blueprint: dict
    # Checkpoint name suffixes whose first dim counts the routed experts: sliced when a real checkpoint has more
    sliced_by_expert: tuple[str, ...] = ()
    stacks: dict = field(default_factory=dict, repr=False)  # <stack>.toml as read, once per record

    @classmethod
    def load(cls, folder: Path) -> Family:
        """The family whose ``family.toml`` is in `folder`; errors name the file, the field and the value."""
        path = folder / "family.toml"
        data = _read(path)
        head, defaults = data.get("family", {}), data.get("config", {})
        rules = ConfigRules(fixed={k: tuple(v) for k, v in data.get("fixed", {}).items()},
                            may_be_zero=tuple(head.get("may_be_zero", ())),
                            checks=tuple((c["holds"], c["error"], c["refuses"]) for c in data.get("check", ())))
        config = make_config(head["name"], head["config_class"], defaults, rules, head.get("about", ""))
        family = cls(name=head["name"], config=config, folder=folder, about=head.get("about", ""),
                     blueprint=data.get("architecture", {}), sliced_by_expert=tuple(head.get("sliced_by_expert", ())))
        config.record = family  # a typed config knows its family: resolved once, passed as it is
        try:
            family.architecture(config())
        except (ExpressionError, KeyError, TypeError, ValueError) as error:
            raise FamilyFileError(f"{path}: [architecture] does not describe the default config: {error}") from None
        return family

    @property
    def names(self) -> Path:
        return self.folder / "names.toml"

    def stack(self, stack: str) -> dict:
        """What `stack`'s builder reads of this family (``<stack>.toml``; empty where the family has none)."""
        if stack not in STACKS:
            raise ValueError(f"no stack {stack!r} (stacks: {', '.join(STACKS)})")
        if stack not in self.stacks:
            path = self.folder / f"{stack}.toml"
            self.stacks[stack] = _read(path) if path.exists() else {}
        return self.stacks[stack]

    @functools.lru_cache(maxsize=256)  # noqa: B019 - records live as long as the process; configs are frozen
    def architecture(self, config) -> Architecture:
        """The blocks and their widths for `config` (``[architecture]``: each field an expression over its keys)."""
        values = config.to_dict()
        blueprint = self.blueprint

        def read(table: dict, record: type, where: str):
            given = {}
            for f in fields(record):
                if f.name not in table:
                    continue
                value = table[f.name]
                value = evaluate(value[1:], values) if isinstance(value, str) and value.startswith("=") else value
                choices = CHOICES.get(f"{where}.{f.name}")
                if choices and value not in choices:
                    raise FamilyFileError(f"{self.folder / 'family.toml'}: [architecture.{where}] {f.name} = "
                                          f"{value!r}: must be one of {choices}")
                given[f.name] = tuple(value) if isinstance(value, (list, range)) else value
            return given

        table = blueprint["attention"]
        indexer = Indexer(**read(table["indexer"], Indexer, "attention.indexer")) if "indexer" in table else None
        compression = blocks.Compression(**read(table["compression"], blocks.Compression, "attention.compression")) \
            if "compression" in table else None
        attention = Attention(**{**read(table, Attention, "attention"), "indexer": indexer,
                                 "compression": compression})
        moe = Moe(**read(blueprint["moe"], Moe, "moe")) if "moe" in blueprint else None
        linear = blocks.LinearAttention(**read(blueprint["linear_attention"], blocks.LinearAttention,
                                               "linear_attention")) \
            if "linear_attention" in blueprint else None
        top = {k: v for k, v in blueprint.items() if k not in ("attention", "moe", "linear_attention")}
        return Architecture(attention=attention, moe=moe, linear_attention=linear,
                            **read(top, Architecture, "architecture"))

    def parameters(self, config) -> list[tuple[str, tuple[int, ...], str]]:
        """(HF checkpoint name, shape, kind) of every parameter and buffer, in forward order; kinds "norm" (weights
        near 1) and "buffer" (not trained, float32 or wider: a routing bias) are read by the harness."""
        return layout.parameters(self.architecture(config))

    def gradients(self, config) -> list[tuple[str, tuple[int, ...]]]:
        """("grad.<name>", shape), in backward order."""
        return layout.gradients(self.architecture(config))

    def detached(self, config) -> list[str]:
        """Parameters the LM loss does not reach (a DSA indexer's): no canonical gradient."""
        return layout.detached(self.architecture(config))

    def modules(self, config, tokens: int) -> list[TensorSpec]:
        """Module outputs at a token count, in forward order."""
        return layout.modules(self.architecture(config), tokens)

    def dense_layers(self, config) -> list[int]:
        return list(self.architecture(config).dense_layers)

    def moe_layers(self, config) -> list[int]:
        a = self.architecture(config)
        return list(a.moe_layers) if a.moe else []

    def routed_experts(self, config) -> int:
        """Per MoE layer (0: a dense model)."""
        moe = self.architecture(config).moe
        return moe.experts if moe else 0

    def interleave(self, config) -> tuple[int, tuple[int, ...]] | None:
        """(groups, per-group widths of q, k, v) for the name maps' interleave rules (harness.families.names); None:
        the family fuses nothing so (MLA)."""
        return layout.interleave(self.architecture(config))

    def buffers(self, config) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the buffers: in the checkpoint and the state a training step may change, never trained."""
        return [(name, shape) for name, shape, kind in self.parameters(config) if kind == "buffer"]



def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise FamilyFileError(f"{path}: not TOML ({error})") from None


__all__ = ["STACKS", "Family", "FamilyFileError", "ModelConfigError"]
