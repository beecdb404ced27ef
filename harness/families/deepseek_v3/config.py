"""DeepSeek-V3's model config, typed: HF ``DeepseekV3Config`` key names, Kimi-K2's values as defaults.

``resolve(given)`` is what a case's ``config.model`` becomes: every default filled (so a runner never falls back on its
library's own), every value checked, errors naming the key and value. ``to_dict()`` is the wire form a request and a
report carry (``family`` last); ``from_dict`` reads it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from harness.families.record import ModelConfigError, typed_value

# Values the harness models only (the implementations hard-code them, or it maps no other).
FIXED = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "tie_word_embeddings": (False,),
         "attention_bias": (False,), "hidden_act": ("silu",), "n_group": (1,), "topk_group": (1,)}


@dataclass(frozen=True)
class RopeScaling:
    """Kimi-K2's YaRN (moonshotai/Kimi-K2-Instruct config.json)."""

    type: str = "yarn"
    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 1.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass(frozen=True)
class DeepseekV3Config:
    """Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json), the DeepSeek-V3 architecture. Widths are the case's
    business; these fill what a case leaves out. A value is kept as given (an int where a float is expected stays an
    int, as the wire dict always had it), but rope_theta, made a float."""

    family: ClassVar[str] = "deepseek_v3"

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 1
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    routed_scaling_factor: float = 2.827
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    # DeepSeek-V3 checkpoints store the rope dims of q_b_proj / kv_a_proj_with_mqa interleaved (pairs); every
    # implementation de-interleaves them before rotating (HF: rope_interleave=True; Megatron MLA: its mla rope path).
    rope_interleave: bool = True

    @classmethod
    def resolve(cls, given: dict) -> DeepseekV3Config:
        """A case's ``config.model`` with every default filled (rope_scaling merged key by key), checked."""
        defaults = DEFAULTS.to_dict()
        del defaults["family"]
        unknown = sorted(set(given) - set(defaults) - {"family"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(defaults))}")
        resolved = {**defaults, **{k: v for k, v in given.items() if k != "family"}}
        if not isinstance(resolved["rope_scaling"], dict):
            raise ModelConfigError(f"rope_scaling must be dict (got {resolved['rope_scaling']!r})")
        resolved["rope_scaling"] = {**defaults["rope_scaling"], **resolved["rope_scaling"]}
        for key, value in resolved.items():
            value = resolved[key] = typed_value(key, value, defaults[key])
            if key == "rope_scaling":
                for inner, inner_value in value.items():
                    if inner not in defaults[key]:
                        raise ModelConfigError(f"unknown key 'rope_scaling.{inner}'; known: "
                                               f"{', '.join(sorted(defaults[key]))}")
                    typed_value(f"rope_scaling.{inner}", inner_value, defaults[key][inner])
            if key in FIXED and value not in FIXED[key]:
                raise ModelConfigError(f"{key} must be one of {FIXED[key]} (the harness models only these) "
                                       f"(got {value!r})")
            if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and key != "first_k_dense_replace":
                raise ModelConfigError(f"{key} must be > 0 (got {value!r})")
        config = cls.from_dict(resolved)
        if config.num_key_value_heads != config.num_attention_heads:
            raise ModelConfigError("num_key_value_heads must equal num_attention_heads (MLA)")
        if not 0 <= config.first_k_dense_replace <= config.num_hidden_layers:
            raise ModelConfigError(f"first_k_dense_replace must be in 0..num_hidden_layers "
                                   f"(got {config.first_k_dense_replace!r})")
        if config.num_experts_per_tok > config.n_routed_experts:
            raise ModelConfigError("num_experts_per_tok must be <= n_routed_experts")
        return config

    @classmethod
    def from_dict(cls, wire: dict) -> DeepseekV3Config:
        """The config a wire dict names (what it leaves out: the defaults); unknown keys are refused, nothing else is
        checked (a request was checked when its case loaded; a test may ask a runner for more, e.g. grouped routing)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(wire) - known - {"family"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        values = {k: v for k, v in wire.items() if k != "family"}
        if "rope_scaling" in values:
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)

    def to_dict(self) -> dict:
        return {**asdict(self), "family": self.family}


DEFAULTS = DeepseekV3Config()
