"""Qwen3-MoE's model config, typed: HF ``Qwen3MoeConfig`` key names (transformers 5.3.0), Qwen3-30B-A3B's values as
defaults.

Where the defaults come from: Qwen/Qwen3-30B-A3B's ``config.json`` as Megatron Bridge's tests copy it,
NVIDIA-NeMo/Megatron-Bridge ``tests/unit_tests/models/qwen/test_qwen3_moe_bridge.py`` @
07d0acf5c150eeb797ee4a8d4cb9b33e4bac9d69 (``qwen3_moe_30b_config_dict``: hidden 2048, ffn 6144, 48 layers, 32 heads
in 4 key/value groups, rms_norm_eps 1e-6, rope_theta 1e6, untied embeddings, vocab 151936, max positions 40960, 128
experts of 768, top-8, ``norm_topk_prob`` true), and Bridge's provider for it, ``src/megatron/bridge/models/qwen/
qwen_provider.py`` @ 53f91f2283278a73b9d135b37f3f1af8727f2db3 (``Qwen3MoEModelProvider30B_A3B``: ``kv_channels``
128, i.e. head_dim 128 != hidden / heads = 64; ``qk_layernorm`` True; ``add_qkv_bias`` False), and
/tmp/zoo-research/FINDINGS.md §1b. Every layer is MoE (``decoder_sparse_step`` 1, ``mlp_only_layers`` []: Bridge's
``Qwen3MoEBridge.megatron_to_hf_config`` writes ``decoder_sparse_step = 1``, "All layers are MoE in Qwen3 MoE"); there
is no shared expert. HF's own ``Qwen3MoeConfig`` defaults are NOT the real values for ``norm_topk_prob`` (False),
``num_hidden_layers`` (24), ``max_position_embeddings`` (32768) and ``head_dim`` (none: hidden / heads) and its
rope_theta comes from ``rope_parameters``; PaddleFormers' defaults ``rope_theta`` 10000 and ``norm_topk_prob`` False:
the harness gives every library every key, never its defaults. Qwen3-235B-A22B differs in widths (hidden 4096, 64
heads, ffn 12288 / 1536, 94 layers), not in kind.

``mlp_only_layers`` and ``decoder_sparse_step`` are honoured as HF and PaddleFormers read them (layer L is dense when
L is in ``mlp_only_layers`` or (L + 1) % ``decoder_sparse_step`` != 0; its MLP is ``intermediate_size`` wide), so that
a diagnostic case can make every layer dense (PaddleFormers' MoE layer does not run in float64). The real models have
none; Megatron Bridge maps neither (its Qwen3-MoE models are MoE in every layer), the harness's Megatron builder
expresses them through ``moe_layer_freq``.

``resolve(given)`` is what a case's ``config.model`` becomes (every default filled, every value checked, errors naming
the key and value); ``to_dict()`` the wire form (``family`` last; ``mlp_only_layers`` a list); ``from_dict`` reads it
back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from harness.families.record import ModelConfigError, resolve_keys, typed_value

# Values the harness models only: no attention bias (HF's attention_bias puts a bias on o_proj too, which Megatron's
# add_qkv_bias cannot: add_bias_linear would bias every linear; the real models have none), untied embeddings, SiLU,
# no sliding window (the real models: use_sliding_window false).
FIXED = {"attention_bias": (False,), "tie_word_embeddings": (False,), "hidden_act": ("silu",),
         "use_sliding_window": (False,)}


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-30B-A3B (module docstring: where each value comes from). Widths are the case's business; these fill what
    a case leaves out. A value is kept as given (an int where a float is expected stays an int), but rope_theta, made
    a float, and mlp_only_layers, a tuple (a list on the wire)."""

    family: ClassVar[str] = "qwen3_moe"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # the dense MLP's width (layers in mlp_only_layers only; none in the real models)
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128  # != hidden_size / num_attention_heads (64): q is 2 x hidden wide
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True  # the top-k softmax probabilities renormalised to sum 1 (HF's class default: False)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_sliding_window: bool = False

    @classmethod
    def resolve(cls, given: dict) -> Qwen3MoeConfig:
        """A case's ``config.model`` with every default filled, checked."""
        defaults = DEFAULTS.to_dict()
        del defaults["family"]
        config = cls.from_dict(resolve_keys(given, defaults, FIXED, _typed))
        if config.num_attention_heads % config.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                                   f"num_key_value_heads (got {config.num_key_value_heads!r})")
        if config.num_experts_per_tok > config.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be <= num_experts (got {config.num_experts_per_tok!r})")
        if config.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even: RoPE rotates pairs of dims (got {config.head_dim!r})")
        bad = [layer for layer in config.mlp_only_layers if not 0 <= layer < config.num_hidden_layers]
        if bad or len(set(config.mlp_only_layers)) != len(config.mlp_only_layers):
            raise ModelConfigError(f"mlp_only_layers must be distinct layers in 0..num_hidden_layers - 1 "
                                   f"(got {list(config.mlp_only_layers)!r})")
        return config

    @classmethod
    def from_dict(cls, wire: dict) -> Qwen3MoeConfig:
        """The config a wire dict names (what it leaves out: the defaults); unknown keys are refused, nothing else is
        checked (a request was checked when its case loaded)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(wire) - known - {"family"})
        if unknown:
            raise ModelConfigError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        values = {k: v for k, v in wire.items() if k != "family"}
        if "mlp_only_layers" in values:
            values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
        return cls(**values)

    def to_dict(self) -> dict:
        return {**asdict(self), "mlp_only_layers": list(self.mlp_only_layers), "family": self.family}

    def is_moe(self, layer: int) -> bool:
        """HF's and PaddleFormers' rule (Qwen3MoeDecoderLayer): a MoE layer unless listed in mlp_only_layers or off
        the decoder_sparse_step grid."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


DEFAULTS = Qwen3MoeConfig()


def _typed(key: str, value, default):
    """``typed_value``, and mlp_only_layers a tuple of ints."""
    if key == "mlp_only_layers":
        if not isinstance(value, (list, tuple)) or not all(type(v) is int for v in value):
            raise ModelConfigError(f"mlp_only_layers must be a list of layer numbers (got {value!r})")
        return tuple(value)
    return typed_value(key, value, default)
