"""GLM-4.5 MoE's model config, typed: HF ``Glm4MoeConfig`` key names (transformers 5.3.0), GLM-4.5-Air's values as
defaults.

Where the defaults come from: GLM-4.5-Air's ``config.json`` (zai-org/GLM-4.5-Air) as Megatron Bridge's provider for it
states it, NVIDIA-NeMo/Megatron-Bridge ``src/megatron/bridge/models/glm/glm45_provider.py`` @
89f594a765a4af366c8ad7e50c61411b4995e78b (``GLMMoEModelProvider``: 96 heads, 8 query groups, kv_channels 128,
add_qkv_bias True, rotary_base 1e6, rotary_percent 0.5, layernorm_epsilon 1e-5, vocab 151552, untied embeddings;
``GLM45AirModelProvider106B``: 46 layers, hidden 4096, ffn 10944, 128 experts of 1408, one shared expert of 1408, the
first layer dense, qk_layernorm False, topk scaling 1.0, top-8), and /tmp/zoo-research/FINDINGS.md §1a. HF's own
``Glm4MoeConfig`` defaults are Air-like but NOT the real values for ``attention_bias`` (False), ``rope_theta`` (10000)
and ``head_dim`` (none: hidden / heads = 42.67): the harness gives transformers every key, never its defaults.
GLM-4.5 (355B-A32B) differs in widths, 3 dense layers, 160 experts, ``use_qk_norm`` True and ``routed_scaling_factor``
2.5 (``GLM45ModelProvider355B``, same file). The multi-token-prediction layer of both (``num_nextn_predict_layers``
1) is not modelled: HF's ``Glm4MoeForCausalLM`` ignores it, and the harness has no MTP.

``resolve(given)`` is what a case's ``config.model`` becomes (every default filled, every value checked, errors naming
the key and value); ``to_dict()`` the wire form (``family`` last); ``from_dict`` reads it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from harness.families.record import ModelConfigError, resolve_keys

# Values the harness models only (every implementation hard-codes them, or a stack maps no other): one routing group,
# normalised top-k probabilities (Megatron's sigmoid router always normalises), untied embeddings, SiLU.
FIXED = {"n_group": (1,), "topk_group": (1,), "norm_topk_prob": (True,), "tie_word_embeddings": (False,),
         "hidden_act": ("silu",)}


@dataclass(frozen=True)
class Glm4MoeConfig:
    """GLM-4.5-Air (module docstring: where each value comes from). Widths are the case's business; these fill what a
    case leaves out. A value is kept as given (an int where a float is expected stays an int), but rope_theta, made a
    float."""

    family: ClassVar[str] = "glm4_moe"

    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128  # != hidden_size / num_attention_heads in GLM-4.5 (128 vs 42.7 Air, 53.3 355B)
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    use_qk_norm: bool = False  # GLM-4.5 (355B): True, per-head RMSNorm of q and k before RoPE
    attention_bias: bool = True  # biases on q_proj, k_proj and v_proj (never on o_proj)
    partial_rotary_factor: float = 0.5  # RoPE on the first head_dim x 0.5 dims of each head (rotate_half)
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    @classmethod
    def resolve(cls, given: dict) -> Glm4MoeConfig:
        """A case's ``config.model`` with every default filled, checked."""
        defaults = DEFAULTS.to_dict()
        del defaults["family"]
        config = cls.from_dict(resolve_keys(given, defaults, FIXED))
        if config.num_attention_heads % config.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                                   f"num_key_value_heads (got {config.num_key_value_heads!r})")
        if not 0 <= config.first_k_dense_replace <= config.num_hidden_layers:
            raise ModelConfigError(f"first_k_dense_replace must be in 0..num_hidden_layers "
                                   f"(got {config.first_k_dense_replace!r})")
        if config.num_experts_per_tok > config.n_routed_experts:
            raise ModelConfigError(f"num_experts_per_tok must be <= n_routed_experts (got "
                                   f"{config.num_experts_per_tok!r})")
        rotary = config.head_dim * config.partial_rotary_factor
        if not 0 < config.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ModelConfigError(f"partial_rotary_factor must be in (0, 1] and head_dim x it an even integer "
                                   f"(got {config.partial_rotary_factor!r} of head_dim {config.head_dim})")
        return config

    @classmethod
    def from_dict(cls, wire: dict) -> Glm4MoeConfig:
        """The config a wire dict names (what it leaves out: the defaults); unknown keys are refused, nothing else is
        checked (a request was checked when its case loaded)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(wire) - known - {"family"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in wire.items() if k != "family"})

    def to_dict(self) -> dict:
        return {**asdict(self), "family": self.family}

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones): head_dim x partial_rotary_factor."""
        return int(self.head_dim * self.partial_rotary_factor)


DEFAULTS = Glm4MoeConfig()
