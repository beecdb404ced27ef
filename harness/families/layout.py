"""Every family's canonical tensors, derived once from its ``Architecture``: each parameter and buffer (HF checkpoint
names), the gradients (gate and up fused as Megatron fuses them) and the module outputs, in the order a step makes
them. Framework-free."""

from __future__ import annotations

from harness.case.specs import FLOAT32_OR_WIDER, TensorSpec
from harness.families import tensors
from harness.families.architecture import Architecture, Attention

Parameter = tuple[str, tuple[int, ...], str]


def parameters(a: Architecture) -> list[Parameter]:
    """(HF checkpoint name, shape, kind) of every parameter in forward order; kind: linear | bias | norm (weights near
    1) | zero_centred_norm (scaled by 1 + weight: near 0) | embedding | router | buffer (the routing bias) | conv |
    decay (a GDN's A_log) | hash (a hash layer's int64 expert table, never trained).
    An indexer's parameters come after MLA's, in HF's order (wq_b, wk, k_norm's weight and bias,
    weights_proj), as the attention calls them; a Gated DeltaNet's in the order its forward uses them."""
    h, norm = a.hidden, _norm_kind(a)
    params: list[Parameter] = [("model.embed_tokens.weight", (a.vocab, h), "embedding")]
    for layer in range(a.layers):
        p = f"model.layers.{layer}."
        params += _hyper_connection(a, p + "attn_hc.")
        params.append((p + "input_layernorm.weight", (h,), norm))
        if a.is_linear(layer):
            params += _linear_attention(a, p + "linear_attn.")
        elif a.attention.kind == "compressed":
            params += _compressed_attention(a, layer, p + "self_attn.")
        else:
            params += _attention(a.attention, h, p + "self_attn.", norm)
            params.append((p + "self_attn.o_proj.weight", (h, a.attention.out_width), "linear"))
        params += _hyper_connection(a, p + "ffn_hc.")
        params.append((p + "post_attention_layernorm.weight", (h,), norm))
        if not a.is_moe(layer):
            params += _mlp(p + "mlp.", a.dense_ffn, h)
            continue
        moe = a.moe
        params.append((p + "mlp.gate.weight", (moe.experts, h), "router"))
        if layer in moe.hash_layers:
            params.append((p + "mlp.gate.tid2eid", (a.vocab, moe.topk), "hash"))
        elif moe.expert_bias:
            params.append((p + moe.expert_bias + ".e_score_correction_bias", (moe.experts,), "buffer"))
        for expert in range(moe.experts):
            params += _mlp(p + f"mlp.experts.{expert}.", moe.ffn, h)
        if moe.shared_ffn:
            params += _mlp(p + f"mlp.{moe.shared_expert}.", moe.shared_ffn, h)
        if moe.shared_gate:
            params.append((p + "mlp.shared_expert_gate.weight", (1, h), "linear"))
    if a.hc_streams:
        n = a.hc_streams
        params += [("model.hc_head.hc_fn", (n, n * h), "linear"), ("model.hc_head.hc_base", (n,), "bias"),
                   ("model.hc_head.hc_scale", (1,), "norm")]
    return params + [("model.norm.weight", (h,), norm), ("lm_head.weight", (a.vocab, h), "linear")]


def _hyper_connection(a: Architecture, p: str) -> list[Parameter]:
    """A hyper-connection's parameters (none without streams): fn maps the n flattened streams to n pre weights, n
    post weights and an n x n mixing matrix; base is added to them; scale (near 1) multiplies each of the three."""
    n, h = a.hc_streams, a.hidden
    if not n:
        return []
    return [(p + "fn", ((2 + n) * n, n * h), "linear"), (p + "base", ((2 + n) * n,), "bias"),
            (p + "scale", (3,), "norm")]


def _compressed_attention(a: Architecture, layer: int, p: str) -> list[Parameter]:
    """DeepSeek-V4's attention (HF's DeepseekV4Attention names), in its forward's order: the q latent and q_b_proj,
    the shared key=value head, the layer's compressor (with the CSA indexer), the sinks, the grouped output
    projection."""
    at, h, c = a.attention, a.hidden, a.attention.compression
    params = [(p + "q_a_proj.weight", (at.q_lora_rank, h), "linear"),
              (p + "q_a_norm.weight", (at.q_lora_rank,), "norm"),
              (p + "q_b_proj.weight", (at.q_width, at.q_lora_rank), "linear"),
              (p + "kv_proj.weight", (at.head_dim, h), "linear"), (p + "kv_norm.weight", (at.head_dim,), "norm")]
    if layer in c.csa_layers:
        params += _compressor(p + "compressor.", c.csa_rate, at.head_dim, 2, h)
        params += _compressed_indexer(at, h, p + "compressor.indexer.")
    elif layer in c.hca_layers:
        params += _compressor(p + "compressor.", c.hca_rate, at.head_dim, 1, h)
    return params + [(p + "sinks", (at.heads,), "bias"),
                     (p + "o_a_proj.weight", (at.o_groups * at.o_lora_rank, at.out_width // at.o_groups), "linear"),
                     (p + "o_b_proj.weight", (h, at.o_groups * at.o_lora_rank), "linear")]


def _compressor(p: str, rate: int, width: int, series: int, h: int) -> list[Parameter]:
    """One compressor: `series` compressed series of `width` (CSA's overlapping two, HCA's one) from kv_proj, their
    softmax weights from gate_proj plus position_bias, and kv_norm over each entry."""
    return [(p + "kv_proj.weight", (series * width, h), "linear"),
            (p + "gate_proj.weight", (series * width, h), "linear"),
            (p + "position_bias", (rate, series * width), "bias"), (p + "kv_norm.weight", (width,), "norm")]


def _compressed_indexer(at: Attention, h: int, p: str) -> list[Parameter]:
    """The CSA layer's lightning indexer: a compressor of its own at indexer.head_dim, q_b_proj from the q latent,
    the scorer's head weights."""
    ix, rate = at.indexer, at.compression.csa_rate
    return [*_compressor(p, rate, ix.head_dim, 2, h), (p + "q_b_proj.weight", (ix.heads * ix.head_dim, at.q_lora_rank),
                                                       "linear"),
            (p + "scorer.weights_proj.weight", (ix.heads, h), "linear")]


def _norm_kind(a: Architecture) -> str:
    return "zero_centred_norm" if a.zero_centred_norms else "norm"


def _linear_attention(a: Architecture, p: str) -> list[Parameter]:
    """A Gated DeltaNet's parameters (HF's Qwen3_5MoeGatedDeltaNet names): the four input projections, the depthwise
    conv over q, k and v ([channels, 1, kernel]), dt_bias and A_log per value head, the gated norm over one value head
    (weight near 1), out_proj."""
    la, h = a.linear_attention, a.hidden
    qkv = 2 * la.key_width + la.value_width
    return [(p + "in_proj_qkv.weight", (qkv, h), "linear"), (p + "in_proj_z.weight", (la.value_width, h), "linear"),
            (p + "in_proj_b.weight", (la.value_heads, h), "linear"),
            (p + "in_proj_a.weight", (la.value_heads, h), "linear"),
            (p + "conv1d.weight", (qkv, 1, la.conv_kernel), "conv"), (p + "dt_bias", (la.value_heads,), "bias"),
            (p + "A_log", (la.value_heads,), "decay"), (p + "norm.weight", (la.value_head_dim,), "norm"),
            (p + "out_proj.weight", (h, la.value_width), "linear")]


def _attention(at: Attention, h: int, p: str, norm: str = "norm") -> list[Parameter]:
    """q, k and v's parameters (o_proj aside): GQA's projections (with their biases) and q/k norms, or MLA's low-rank
    projections and their norms."""
    if at.kind == "mla":
        rope = at.rotary_dim
        return [(p + "q_a_proj.weight", (at.q_lora_rank, h), "linear"),
                (p + "q_a_layernorm.weight", (at.q_lora_rank,), "norm"),
                (p + "q_b_proj.weight", (at.q_width, at.q_lora_rank), "linear"),
                (p + "kv_a_proj_with_mqa.weight", (at.kv_lora_rank + rope, h), "linear"),
                (p + "kv_a_layernorm.weight", (at.kv_lora_rank,), "norm"),
                (p + "kv_b_proj.weight", (at.heads * (at.head_dim - rope + at.v_head_dim), at.kv_lora_rank),
                 "linear"), *_indexer(at, h, p)]
    params: list[Parameter] = []
    for name, width in (("q_proj", at.q_proj_width), ("k_proj", at.kv_width), ("v_proj", at.kv_width)):
        params.append((p + f"{name}.weight", (width, h), "linear"))
        if at.qkv_bias:
            params.append((p + f"{name}.bias", (width,), "bias"))
    if at.qk_norm != "none":
        per_head = at.qk_norm == "per_head"
        params += [(p + "q_norm.weight", (at.head_dim if per_head else at.q_width,), norm),
                   (p + "k_norm.weight", (at.head_dim if per_head else at.kv_width,), norm)]
    return params


def _indexer(at: Attention, h: int, p: str) -> list[Parameter]:
    """DSA's indexer (none without one): wq_b reads MLA's q latent (q_lora_rank), wk and weights_proj the hidden state;
    k_norm is a LayerNorm (weight and bias)."""
    ix = at.indexer
    if ix is None:
        return []
    p += "indexer."
    return [(p + "wq_b.weight", (ix.heads * ix.head_dim, at.q_lora_rank), "linear"),
            (p + "wk.weight", (ix.head_dim, h), "linear"),
            (p + "k_norm.weight", (ix.head_dim,), "norm"), (p + "k_norm.bias", (ix.head_dim,), "bias"),
            (p + "weights_proj.weight", (ix.heads, h), "linear")]


def detached(a: Architecture) -> list[str]:
    """The parameters the LM loss does not reach, so without a canonical gradient: the indexer's (HF computes it under
    no_grad, Megatron's DSAttention detaches its inputs; only Megatron's own indexer loss would train it; DeepSeek-V4's
    CSA indexer returns top-k indices only)."""
    at = a.attention
    if at.kind == "compressed":
        return [name for layer in at.compression.csa_layers for name, _, _ in _compressed_indexer(
            at, a.hidden, f"model.layers.{layer}.self_attn.compressor.indexer.")]
    return [name for layer in range(a.layers) for name, _, _ in _indexer(at, a.hidden,
                                                                          f"model.layers.{layer}.self_attn.")]


def _mlp(p: str, ffn: int, h: int) -> list[Parameter]:
    return [(p + "gate_proj.weight", (ffn, h), "linear"), (p + "up_proj.weight", (ffn, h), "linear"),
            (p + "down_proj.weight", (h, ffn), "linear")]


def gradients(a: Architecture) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical gradient names and shapes, in backward order (harness.families.tensors); none for `detached` ones."""
    untrained = set(detached(a))
    return tensors.gradients([p for p in parameters(a) if p[0] not in untrained])


def modules(a: Architecture, tokens: int) -> list[TensorSpec]:
    """Module outputs in forward order (canonical HF module paths). Per-head q/k norms keep their heads apart
    ([T, heads, head_dim]); norms over all heads are [T, heads x head_dim]. A MoE layer: the routing (top-k indices,
    probabilities), each routed expert's output, the shared expert's (and its gate's logit, [T, 1]), the MoE output.
    A DSA indexer: its projections' outputs and the keys it selects, as ``indexer.selected`` (`_attention_outputs`).
    A Gated DeltaNet: its projections, its gated norm's output (``core_attention``, what out_proj reads) and out_proj
    (`_linear_attention_outputs`)."""
    h, t, at = a.hidden, tokens, a.attention
    specs = [TensorSpec("module.model.embed_tokens", (t, h), "output")]
    for layer in range(a.layers):
        p = f"module.model.layers.{layer}."
        specs.append(TensorSpec(p + "input_layernorm", (t, h), "output"))
        if a.is_linear(layer):
            specs += [TensorSpec(p + "linear_attn." + name, (t, *shape), "output")
                      for name, shape in _linear_attention_outputs(a)]
        elif at.kind == "compressed":
            specs += _compressed_attention_outputs(a, layer, t, p + "self_attn.")
        else:
            # kv_b_proj: optional beside an indexer (Megatron's DSA attention absorbs it, never computing its output)
            specs += [TensorSpec(p + "self_attn." + name, (t, *shape), "output",
                                 optional=bool(at.indexer) and name == "kv_b_proj")
                      for name, shape in _attention_outputs(at)]
            if at.indexer:
                specs.append(TensorSpec(p + "self_attn.indexer.selected", (t, t), "output", "int64"))
            specs += [TensorSpec(p + "self_attn.core_attention", (t, at.out_width), "output"),
                      TensorSpec(p + "self_attn.o_proj", (t, h), "output")]
        specs.append(TensorSpec(p + "post_attention_layernorm", (t, h), "output"))
        if not a.is_moe(layer):
            f = a.dense_ffn
            specs += [TensorSpec(p + "mlp.gate_up_proj", (t, 2 * f), "output"),
                      TensorSpec(p + "mlp.act", (t, f), "output"), TensorSpec(p + "mlp.down_proj", (t, h), "output")]
        else:
            moe = a.moe
            specs += [TensorSpec(p + "mlp.gate.topk_indices", (t, moe.topk), "output", "int64"),
                      TensorSpec(p + "mlp.gate.probs", (t, moe.experts), "output",
                                 None if moe.scores_in_model_dtype else FLOAT32_OR_WIDER)]
            specs += [TensorSpec(p + f"mlp.experts.{x}", (-1, h), "output", optional=True) for x in range(moe.experts)]
            if moe.shared_ffn:
                specs.append(TensorSpec(p + f"mlp.{moe.shared_expert}", (t, h), "output"))
            if moe.shared_gate:
                specs.append(TensorSpec(p + "mlp.shared_expert_gate", (t, 1), "output", optional=True))
            specs.append(TensorSpec(p + "mlp", (t, h), "output"))
        specs.append(TensorSpec(p.rstrip("."), (t, a.hc_streams, h) if a.hc_streams else (t, h), "output"))
    if a.hc_streams:
        specs.append(TensorSpec("module.model.hc_head", (t, h), "output"))
    specs.append(TensorSpec("module.model.norm", (t, h), "output"))
    return specs


def _compressed_attention_outputs(a: Architecture, layer: int, t: int, p: str) -> list[TensorSpec]:
    """A DeepSeek-V4 attention's outputs: its projections and norms ([T, width]), its compressor's (kv_norm: one row
    per compressed entry, T // rate), the CSA indexer's and which entries it selects (``indexer.selected`` [T, T //
    rate] int64: 1 where query i attends entry j; the indexer's -1 picks, past the causal edge, attend nothing), what
    o_a_proj reads (``core_attention``, per group) and the grouped output projection. The hyper-connections are
    reached through input_layernorm (the streams they collapse) and the layer's output (the streams they mix)."""
    at, h, c = a.attention, a.hidden, a.attention.compression
    out = [("q_a_proj", (t, at.q_lora_rank)), ("q_a_norm", (t, at.q_lora_rank)), ("q_b_proj", (t, at.q_width)),
           ("kv_proj", (t, at.head_dim)), ("kv_norm", (t, at.head_dim))]
    selected = []
    for rate, series, layers in ((c.csa_rate, 2, c.csa_layers), (c.hca_rate, 1, c.hca_layers)):
        if layer not in layers:
            continue
        out += [(f"compressor.{name}", shape) for name, shape in _compressor_outputs(t, rate, at.head_dim, series)]
        if series == 2:
            ix = at.indexer
            out += [(f"compressor.indexer.{name}", shape) for name, shape in
                    _compressor_outputs(t, rate, ix.head_dim, 2)]
            out += [("compressor.indexer.q_b_proj", (t, ix.heads * ix.head_dim)),
                    ("compressor.indexer.scorer.weights_proj", (t, ix.heads))]
            selected = [TensorSpec(p + "compressor.indexer.selected", (t, t // rate), "output", "int64")]
    specs = [TensorSpec(p + name, shape, "output") for name, shape in out] + selected
    group = at.out_width // at.o_groups
    return specs + [TensorSpec(p + "core_attention", (t, at.o_groups, group), "output"),
                    TensorSpec(p + "o_a_proj", (t, at.o_groups, at.o_lora_rank), "output"),
                    TensorSpec(p + "o_b_proj", (t, h), "output")]


def _compressor_outputs(t: int, rate: int, width: int, series: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("kv_proj", (t, series * width)), ("gate_proj", (t, series * width)), ("kv_norm", (t // rate, width))]


def _linear_attention_outputs(a: Architecture) -> list[tuple[str, tuple[int, ...]]]:
    """A GDN layer's outputs, each [T, width]: its four input projections, ``core_attention`` (the delta rule's output
    through the gated norm, as out_proj reads it) and out_proj. Its conv (a [channels, T + kernel - 1] output, padded
    on both sides) and the delta rule (a function, no module) are reached through them."""
    la = a.linear_attention
    return [("in_proj_qkv", (2 * la.key_width + la.value_width,)), ("in_proj_z", (la.value_width,)),
            ("in_proj_b", (la.value_heads,)), ("in_proj_a", (la.value_heads,)), ("core_attention", (la.value_width,)),
            ("out_proj", (a.hidden,))]


def _attention_outputs(at: Attention) -> list[tuple[str, tuple[int, ...]]]:
    if at.kind == "mla":
        rope = at.rotary_dim
        return [("q_a_proj", (at.q_lora_rank,)), ("q_a_layernorm", (at.q_lora_rank,)), ("q_b_proj", (at.q_width,)),
                ("kv_a_proj_with_mqa", (at.kv_lora_rank + rope,)), ("kv_a_layernorm", (at.kv_lora_rank,)),
                ("kv_b_proj", (at.heads * (at.head_dim - rope + at.v_head_dim),)), *_indexer_outputs(at)]
    outputs = [("q_proj", (at.q_proj_width,)), ("k_proj", (at.kv_width,)), ("v_proj", (at.kv_width,))]
    if at.qk_norm == "per_head":
        outputs += [("q_norm", (at.heads, at.head_dim)), ("k_norm", (at.kv_heads, at.head_dim))]
    elif at.qk_norm == "all_heads":
        outputs += [("q_norm", (at.q_width,)), ("k_norm", (at.kv_width,))]
    return outputs


def _indexer_outputs(at: Attention) -> list[tuple[str, tuple[int, ...]]]:
    """The indexer's projections, each as its module returns it (wq_b before RoPE). What it selects is captured apart
    (`modules`): ``indexer.selected`` [T, T] int64, 1 where query i attends key j (chosen and causal), not its top-k
    indices: among keys the causal mask removes, every score is -inf and which of them top-k lists is arbitrary
    (measured: [0, 6, 5] for query 0 with top-3 of 8), and the order of equal scores is no result either; the set of
    attended keys is what reaches the attention."""
    ix = at.indexer
    if ix is None:
        return []
    return [("indexer.wq_b", (ix.heads * ix.head_dim,)), ("indexer.wk", (ix.head_dim,)),
            ("indexer.k_norm", (ix.head_dim,)), ("indexer.weights_proj", (ix.heads,))]


def interleave(a: Architecture) -> tuple[int, tuple[int, ...]] | None:
    """How a stack that fuses q, k and v per key/value head (Megatron's linear_qkv, Paddle's qkv_proj) orders them:
    per query group, its heads / groups query heads, then its key head, then its value head (Megatron Bridge's
    QKVMapping / merge_qkv_weights, conversion/param_mapping.py @ 0f418defd83bb8b007f00748e822b3e758ec2593); an
    output-gated q_proj is twice as wide (Megatron's linear_qkv with attention_output_gate: each group's queries, then
    their gates; the Megatron name map reorders HF's per-head query, gate rows so, gated_rows). None for MLA, which
    fuses nothing so."""
    at = a.attention
    if at.kind != "gqa":
        return None
    return at.kv_heads, (at.heads // at.kv_heads * at.head_dim * (2 if at.output_gate else 1), at.head_dim,
                         at.head_dim)
