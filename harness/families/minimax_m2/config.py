"""MiniMax-M2's model config, typed: HF ``MiniMaxM2Config`` key names (transformers 5.3.0), plus the keys of the
released checkpoints' ``config.json`` that transformers 5.3.0 does not read (``rotary_dim``, ``use_qk_norm``,
``qk_norm_type``, ``scoring_func``, ``use_routing_bias``); MiniMax-M2's real values as defaults.

Where the defaults come from:
- transformers 5.3.0 ``MiniMaxM2Config`` (its docstring: "defaults will yield a similar configuration to that of
  MiniMaxAI/MiniMax-M2"): vocab 200064, hidden 3072, intermediate_size 1536 (the width of each routed expert: the
  model has no dense MLP), 62 layers, 48 heads, 8 key/value heads, head_dim 128 (heads x head_dim = 6144 = 2 x
  hidden), 256 local experts, top-8, rms_norm_eps 1e-6, rope theta 5e6 (``default_theta``), max positions 196608,
  untied embeddings, SiLU.
- PaddleFormers 1.2.0 ``paddleformers/transformers/minimax_m2/configuration.py`` (``MiniMaxM2Config`` defaults, the
  same model): ``rotary_dim`` 64, ``use_qk_norm`` True, ``qk_norm_type`` "per_layer", ``scoring_func`` "sigmoid",
  ``use_routing_bias`` True, no shared expert, every layer MoE (``first_k_dense_replace`` 0, ``moe_layer_freq`` 1).
- huggingface/transformers issue #48241 (and PR #48486, merged after 5.3.0): the released MiniMaxAI/MiniMax-M2*
  checkpoints say ``rotary_dim: 64`` of ``head_dim: 128`` (partial RoPE, factor 0.5) through that legacy key, which
  transformers 5.3.0 keeps as an opaque attribute and never turns into ``rope_parameters``: a real ``config.json``
  loaded by 5.3.0 gets full-head RoPE. The harness derives ``partial_rotary_factor = rotary_dim / head_dim`` and gives
  it to every stack (``hf.py`` passes it explicitly).
- Megatron Bridge ``src/megatron/bridge/models/minimax_m2/minimax_m2_bridge.py`` @
  39b79eb785325f8e4e5dc2400ff3924824e3121c reads the same keys (``rotary_percent = rotary_dim / head_dim``, sigmoid
  scores, expert bias, the full-dimension q/k norm).
- /tmp/zoo-research/FINDINGS.md §1c: the routing (sigmoid of the router logits, top-k of scores + bias, the chosen
  scores divided by their sum, no epsilon, no routed scaling) and the q/k norm (one RMSNorm over all heads of a
  token: q_norm weight [heads x head_dim], k_norm [kv_heads x head_dim]).
The multi-token-prediction modules (``use_mtp``, 3 modules) are not modelled: HF's ``MiniMaxM2ForCausalLM`` has
none, and the harness has no MTP.

``resolve(given)`` is what a case's ``config.model`` becomes (every default filled, every value checked, errors naming
the key and value); ``to_dict()`` the wire form (``family`` last); ``from_dict`` reads it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from harness.families.record import ModelConfigError, resolve_keys

# Values the harness models only (what MiniMax-M2 is; no stack here maps another): the all-heads q/k RMSNorm
# ("per_layer"), sigmoid scores with the routing bias, untied embeddings, SiLU.
FIXED = {"use_qk_norm": (True,), "qk_norm_type": ("per_layer",), "scoring_func": ("sigmoid",),
         "use_routing_bias": (True,), "tie_word_embeddings": (False,), "hidden_act": ("silu",)}


@dataclass(frozen=True)
class MiniMaxM2Config:
    """MiniMax-M2 (module docstring: where each value comes from; M2.5 and M2.7 have the same architecture). Widths
    are the case's business; these fill what a case leaves out. A value is kept as given (an int where a float is
    expected stays an int), but rope_theta, made a float."""

    family: ClassVar[str] = "minimax_m2"

    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536  # each routed expert's width (HF's name; there is no dense MLP)
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128  # != hidden_size / num_attention_heads (64): heads x head_dim = 2 x hidden
    num_local_experts: int = 256  # every layer MoE, no shared expert
    num_experts_per_tok: int = 8
    rotary_dim: int = 64  # RoPE on the first 64 of each head's 128 dims (checkpoint key; transformers 5.3 ignores it)
    rope_theta: float = 5000000.0
    use_qk_norm: bool = True
    qk_norm_type: str = "per_layer"  # one RMSNorm over all heads of a token (q: [heads x head_dim], k: [kv x hd])
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True  # e_score_correction_bias, added to the scores for the choice only
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 196608
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    @classmethod
    def resolve(cls, given: dict) -> MiniMaxM2Config:
        """A case's ``config.model`` with every default filled, checked."""
        defaults = DEFAULTS.to_dict()
        del defaults["family"]
        config = cls.from_dict(resolve_keys(given, defaults, FIXED))
        if config.num_attention_heads % config.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                                   f"num_key_value_heads (got {config.num_key_value_heads!r})")
        if config.num_experts_per_tok > config.num_local_experts:
            raise ModelConfigError(f"num_experts_per_tok must be <= num_local_experts (got "
                                   f"{config.num_experts_per_tok!r})")
        if config.rotary_dim > config.head_dim or config.rotary_dim % 2:
            raise ModelConfigError(f"rotary_dim must be even and <= head_dim ({config.head_dim}) "
                                   f"(got {config.rotary_dim!r})")
        return config

    @classmethod
    def from_dict(cls, wire: dict) -> MiniMaxM2Config:
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
    def partial_rotary_factor(self) -> float:
        """The fraction of each head RoPE rotates: rotary_dim / head_dim (0.5 for MiniMax-M2), what transformers
        5.3.0 and Megatron take (``rope_parameters.partial_rotary_factor``, ``rotary_percent``)."""
        return self.rotary_dim / self.head_dim


DEFAULTS = MiniMaxM2Config()
