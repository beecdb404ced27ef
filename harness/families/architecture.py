"""What a model family is made of, as the harness describes it once for every framework: the blocks (attention, the
MLP or MoE of each layer, the norms) and their settings, with the widths of one typed config filled in.

A family's ``family.toml`` says in its ``[architecture]`` table how each field here is read from its config (an
expression over the HF config keys: ``harness.families.expressions``); ``Family.architecture(config)`` gives the
result. The canonical tensors (``harness.families.layout``) and every framework's builder read this record, never a
family's name, except for a quirk the builder names where it handles it.
"""

from __future__ import annotations

from dataclasses import dataclass

# grouped-query attention (MHA when kv_heads == heads); multi-latent attention; DeepSeek-V4's compressed attention
ATTENTION_KINDS = ("gqa", "mla", "compressed")
QK_NORMS = ("none", "per_head", "all_heads")  # RMSNorm of q and k: none, over each head, over all heads of a token
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")  # the router's scores (sqrtsoftplus: sqrt(softplus(x)), DeepSeek-V4)


@dataclass(frozen=True)
class Indexer:
    """DeepSeek Sparse Attention's lightning indexer (GLM-5, DeepSeek-V3.2), one per layer: it scores every earlier
    key for each query (``heads`` heads of ``head_dim``: wq_b from MLA's q latent, wk from the hidden state, k_norm a
    LayerNorm with a bias, weights_proj weighting the heads) and the attention sees each query's ``topk`` best keys
    only. Its inputs are detached from the LM loss (HF runs it under no_grad, Megatron detaches its inputs)."""

    heads: int
    head_dim: int  # its RoPE part is the attention's rotary_dim
    topk: int


@dataclass(frozen=True)
class Compression:
    """DeepSeek-V4's compressed KV (attention kind "compressed"), added to a sliding window of the layer's own keys:
    in ``csa_layers`` (compressed sparse attention) each ``csa_rate`` tokens make one entry from two overlapping
    series (kv_proj and gate_proj twice as wide, a softmax over 2 x csa_rate slots), and the attention's ``indexer``
    picks each query's top-k entries; in ``hca_layers`` (heavily compressed attention) each ``hca_rate`` tokens make
    one entry, every earlier one attended. Each compressor: kv_proj, gate_proj, position_bias [rate, width], kv_norm;
    the CSA indexer has its own compressor of ``indexer.head_dim``, q_b_proj from the q latent and
    scorer.weights_proj, and, returning indices only, gets no gradient."""

    csa_layers: tuple[int, ...]
    hca_layers: tuple[int, ...]
    csa_rate: int
    hca_rate: int
    window: int  # the sliding window of the layer's own (uncompressed) keys


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (Qwen3.5, Qwen3-Next), in the layers ``Architecture.linear_layers`` instead of self-attention
    (HF's ``linear_attn``): in_proj_qkv (q and k ``key_heads`` x ``key_head_dim``, v ``value_heads`` x
    ``value_head_dim``), in_proj_z (the output gate), in_proj_b (beta) and in_proj_a (the decay's input), one per value
    head; a depthwise causal conv1d of ``conv_kernel`` taps over q, k and v, then SiLU; the gated delta rule with
    per-head dt_bias and A_log; a gated RMSNorm over each value head (weight near 1, not zero-centred); out_proj."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class Attention:
    """One layer's self-attention. ``kind`` "gqa": q_proj, k_proj, v_proj, o_proj (biases on q, k, v when
    ``qkv_bias``); "mla": q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    (and an ``indexer`` with DSA); "compressed" (DeepSeek-V4): q_a_proj, q_a_norm, q_b_proj (then an unweighted
    per-head RMSNorm), one shared key=value head (kv_proj, kv_norm), a learned sink per head, the ``compression``
    of its layer, and the grouped output projection (o_a_proj: ``o_groups`` blocks of heads x head_dim / o_groups to
    o_lora_rank each; o_b_proj) in place of o_proj."""

    kind: str
    heads: int
    kv_heads: int
    head_dim: int  # q and k per head (MLA: its no-RoPE part plus its RoPE part)
    v_head_dim: int
    rotary_dim: int  # the dims of each q/k head that RoPE rotates (MLA: qk_rope_head_dim)
    rope_theta: float
    qkv_bias: bool = False
    qk_norm: str = "none"
    q_lora_rank: int = 0  # MLA only
    kv_lora_rank: int = 0  # MLA only
    indexer: Indexer | None = None  # DSA (MLA only); None: dense attention over every earlier key
    # GQA only: q_proj is twice as wide, per head its query then its gate; o_proj reads the attention times
    # sigmoid(gate) (Qwen3.5's gated attention)
    output_gate: bool = False
    compression: Compression | None = None  # kind "compressed" only
    o_groups: int = 0  # kind "compressed" only: the grouped output projection's groups
    o_lora_rank: int = 0  # kind "compressed" only: each group's output width

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def out_width(self) -> int:
        """The width o_proj reads: heads x v_head_dim."""
        return self.heads * self.v_head_dim

    @property
    def q_proj_width(self) -> int:
        """q_proj's output: the queries, and as wide again with an output gate."""
        return self.q_width * (2 if self.output_gate else 1)


@dataclass(frozen=True)
class Moe:
    """One MoE layer: a router over ``experts`` routed experts of ``ffn`` each, top-``topk`` per token, and an optional
    shared expert (``shared_ffn`` wide; 0: none), gated by a sigmoid of one linear when ``shared_gate``."""

    experts: int
    topk: int
    ffn: int
    scoring: str  # softmax | sigmoid
    norm_topk: bool  # the chosen k probabilities divided by their sum
    topk_scaling: float = 1.0  # multiplies the routing weights (routed_scaling_factor)
    expert_bias: str = ""  # the module holding the routing bias (e_score_correction_bias), under the layer; "": none
    shared_ffn: int = 0
    shared_expert: str = "shared_experts"  # its module under the layer's mlp (the HF checkpoint's name)
    shared_gate: bool = False  # mlp.shared_expert_gate: [1, hidden], sigmoid of it scales the shared expert
    # Layers routed by a fixed table instead of the top-k: the experts of token t are mlp.gate.tid2eid[t] (an int64
    # buffer [vocab, topk] of the checkpoint; DeepSeek-V4's hash layers); the router's scores still weight them
    hash_layers: tuple[int, ...] = ()
    swiglu_limit: float = 0.0  # > 0: every expert's gate clamped to <= limit and up to [-limit, limit] (DeepSeek-V4)
    # The router's scores and routing weights in the model's dtype (DeepSeek-V4's routers cast nothing); else in
    # float32 or wider, as the other families' HF routers compute them
    scores_in_model_dtype: bool = False


@dataclass(frozen=True)
class Architecture:
    """A whole causal LM: embedding, ``layers`` decoder layers (pre-norm attention, or Gated DeltaNet in
    ``linear_layers``; pre-norm MLP: dense in ``dense_layers``, MoE in the others), final norm, untied lm_head; every
    norm an RMSNorm of ``norm_eps``. With ``zero_centred_norms`` the layer, final and q/k norms scale by 1 + weight
    (the checkpoint holds weights near 0: Qwen3.5's ``output * (1.0 + weight)``); a GDN's gated norm does not. With
    ``hc_streams`` > 0 (DeepSeek-V4's manifold-constrained hyper-connections) the residual is that many streams
    ([T, streams, hidden]): before the attention and before the MLP a hyper-connection (attn_hc, ffn_hc: fn, base,
    scale) collapses them into the block's input and mixes the block's output back in; model.hc_head (hc_fn,
    hc_base, hc_scale) collapses them before the final norm."""

    vocab: int
    hidden: int
    layers: int
    attention: Attention
    dense_ffn: int  # the dense MLP's width (layers in dense_layers)
    dense_layers: tuple[int, ...]
    moe: Moe | None
    norm_eps: float
    linear_attention: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()  # the layers whose token mixer is linear_attention (none without one)
    zero_centred_norms: bool = False
    hc_streams: int = 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.layers) if layer not in self.dense_layers)

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers

    def is_linear(self, layer: int) -> bool:
        return self.linear_attention is not None and layer in self.linear_layers
