"""Qwen2-MoE's model config, typed: HF ``Qwen2MoeConfig`` key names (transformers 5.3.0), Qwen1.5-MoE-A2.7B's values
as defaults.

Where the defaults come from: Qwen/Qwen1.5-MoE-A2.7B's ``config.json`` (the architecture transformers' own
``Qwen2MoeConfig`` defaults describe, and the config Qwen's GPTQ release of the chat model ships): hidden 2048, 24
layers, 16 query heads and 16 key/value heads (multi-head: head_dim 128 = hidden / heads), rms_norm_eps 1e-6,
rope_theta 1e6, untied embeddings, vocab 151936, max positions 32768, 60 routed experts of 1408 (0.6875 x hidden),
top-4, ``norm_topk_prob`` false (the top-4 softmax probabilities are used as they are), one shared expert of 5632 (4
x 1408: "four always-active shared experts" fused into one MLP) behind a sigmoid ``shared_expert_gate``, every layer
MoE (``decoder_sparse_step`` 1, no ``mlp_only_layers``), q/k/v biases (``qkv_bias``: transformers 5.3.0's key, true
by default; the checkpoint holds q_proj.bias, k_proj.bias, v_proj.bias and no o_proj bias). Qwen2-57B-A14B differs in
widths and in grouping (hidden 3584, 28 heads in 4 key/value groups, 64 experts of 2560, top-8, shared expert 20480,
dense width 18944, 28 layers), not in kind. PaddleFormers' default ``rope_theta`` is 10000: the harness gives every
library every key, never its defaults.

``mlp_only_layers`` and ``decoder_sparse_step`` are honoured as HF reads them (layer L is dense when L is in
``mlp_only_layers`` or (L + 1) % ``decoder_sparse_step`` != 0; its MLP is ``intermediate_size`` wide), for a
diagnostic case (the real models have none). PaddleFormers 1.2.0's ``Qwen2MoeDecoderLayer`` ignores both (every layer
is MoE when num_experts > 0): its builder expresses a model whose every layer is dense (num_experts 0 there, the same
model) and refuses a mix (UNSUPPORTED, paddle.py).

``resolve(given)`` is what a case's ``config.model`` becomes (every default filled, every value checked, errors naming
the key and value); ``to_dict()`` the wire form (``family`` last; ``mlp_only_layers`` a list); ``from_dict`` reads it
back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from harness.families.record import ModelConfigError, resolve_keys, typed_value

# Values the harness models only: q/k/v biases (the real models'), untied embeddings, SiLU, no sliding window (the
# real models: use_sliding_window false).
FIXED = {"qkv_bias": (True,), "tie_word_embeddings": (False,), "hidden_act": ("silu",),
         "use_sliding_window": (False,)}


@dataclass(frozen=True)
class Qwen2MoeConfig:
    """Qwen1.5-MoE-A2.7B (module docstring: where each value comes from). Widths are the case's business; these fill
    what a case leaves out. A value is kept as given (an int where a float is expected stays an int), but rope_theta,
    made a float, and mlp_only_layers, a tuple (a list on the wire)."""

    family: ClassVar[str] = "qwen2_moe"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632  # the dense MLP's width (layers in mlp_only_layers only; none in the real models)
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    num_experts: int = 60
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = False  # the top-k softmax probabilities used as they are (not renormalised)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qkv_bias: bool = True
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_sliding_window: bool = False

    @property
    def head_dim(self) -> int:
        """hidden_size / num_attention_heads (Qwen2-MoE has no head_dim key)."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def resolve(cls, given: dict) -> Qwen2MoeConfig:
        """A case's ``config.model`` with every default filled, checked."""
        defaults = DEFAULTS.to_dict()
        del defaults["family"]
        config = cls.from_dict(resolve_keys(given, defaults, FIXED, _typed))
        if config.hidden_size % config.num_attention_heads:
            raise ModelConfigError(f"hidden_size ({config.hidden_size}) must be a multiple of num_attention_heads "
                                   f"(got {config.num_attention_heads!r})")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                                   f"num_key_value_heads (got {config.num_key_value_heads!r})")
        if config.num_experts_per_tok > config.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be <= num_experts (got {config.num_experts_per_tok!r})")
        if config.head_dim % 2:
            raise ModelConfigError(f"hidden_size / num_attention_heads must be even: RoPE rotates pairs of dims (got "
                                   f"{config.head_dim!r})")
        bad = [layer for layer in config.mlp_only_layers if not 0 <= layer < config.num_hidden_layers]
        if bad or len(set(config.mlp_only_layers)) != len(config.mlp_only_layers):
            raise ModelConfigError(f"mlp_only_layers must be distinct layers in 0..num_hidden_layers - 1 "
                                   f"(got {list(config.mlp_only_layers)!r})")
        return config

    @classmethod
    def from_dict(cls, wire: dict) -> Qwen2MoeConfig:
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
        """HF's rule (Qwen2MoeDecoderLayer): a MoE layer unless listed in mlp_only_layers or off the
        decoder_sparse_step grid."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


DEFAULTS = Qwen2MoeConfig()


def _typed(key: str, value, default):
    """``typed_value``, and mlp_only_layers a tuple of ints."""
    if key == "mlp_only_layers":
        if not isinstance(value, (list, tuple)) or not all(type(v) is int for v in value):
            raise ModelConfigError(f"mlp_only_layers must be a list of layer numbers (got {value!r})")
        return tuple(value)
    return typed_value(key, value, default)
