"""HF transformers' DeepseekV3ForCausalLM as the float64 reference for the megatron_model runner: canonical module
outputs (hooks) and gradients (docs/model-contract.md), computed in the test itself.

`lift_hf_fp32_islands` patches, for the duration of a `with`, the places where HF computes in float32 whatever the
model dtype (RMSNorm, router logits), so that a float64 HF model computes in float64 except its float32 RoPE table;
`megatron_islands=True` adds the float32 islands Megatron forces (sigmoid of the router logits, the RoPE table
formula), so that the remaining difference is the mapping alone."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def lift_hf_fp32_islands(megatron_islands: bool = False):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    saved = (m.DeepseekV3RMSNorm.forward, m.DeepseekV3TopkRouter.forward, m.DeepseekV3MoE.route_tokens_to_experts,
             m.DeepseekV3RotaryEmbedding.forward)

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def router_forward(self, x):
        return F.linear(x.view(-1, self.config.hidden_size), self.weight)

    original_route = m.DeepseekV3MoE.route_tokens_to_experts

    def route(self, logits):
        if megatron_islands:  # Megatron: torch.sigmoid(logits.float()).type_as(logits)
            scores = torch.sigmoid(logits.float()).to(logits.dtype)
            return _route_from_scores(self, scores)
        return original_route(self, logits)

    original_rope = m.DeepseekV3RotaryEmbedding.forward

    def rope_forward(self, x, position_ids):  # HF's own table is float32 (as Megatron's is): kept unless imitating
        return _megatron_rope_table(self, x, position_ids) if megatron_islands else original_rope(self, x, position_ids)

    m.DeepseekV3RMSNorm.forward = rms_forward
    m.DeepseekV3TopkRouter.forward = router_forward
    m.DeepseekV3MoE.route_tokens_to_experts = route
    m.DeepseekV3RotaryEmbedding.forward = rope_forward
    try:
        yield
    finally:
        (m.DeepseekV3RMSNorm.forward, m.DeepseekV3TopkRouter.forward, m.DeepseekV3MoE.route_tokens_to_experts,
         m.DeepseekV3RotaryEmbedding.forward) = saved


def _route_from_scores(moe, scores):
    """HF's route_tokens_to_experts from already computed sigmoid scores (same code after its sigmoid)."""
    choice = scores + moe.gate.e_score_correction_bias
    group_scores = choice.view(-1, moe.n_group, moe.n_routed_experts // moe.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, moe.n_group, moe.n_routed_experts // moe.n_group).reshape(
        -1, moe.n_routed_experts)
    topk_indices = torch.topk(choice.masked_fill(~score_mask.bool(), 0.0), k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, topk_indices)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_indices, weights * moe.routed_scaling_factor


def _megatron_rope_table(rotary, x, position_ids):
    """cos/sin as Megatron's YarnRotaryEmbedding + _apply_rotary_pos_emb_bshd build them (float32 freqs)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    p = rotary.config.rope_parameters
    dim = rotary.config.qk_rope_head_dim
    yarn = YarnRotaryEmbedding.__new__(YarnRotaryEmbedding)
    torch.nn.Module.__init__(yarn)
    yarn.__dict__.update(dim=dim, rotary_base=p["rope_theta"], scaling_factor=p["factor"],
                         original_max_position_embeddings=p["original_max_position_embeddings"],
                         beta_fast=p.get("beta_fast", 32), beta_slow=p.get("beta_slow", 1), mscale=p.get("mscale", 1),
                         mscale_all_dim=p.get("mscale_all_dim", 0), correction_range_round_to_int=True,
                         rotary_interleaved=False)
    ar = torch.arange(0, dim, 2, dtype=torch.float32)
    yarn.inv_freq_extra = 1.0 / (yarn.rotary_base ** (ar / dim))
    yarn.inv_freq_inter = 1.0 / (yarn.scaling_factor * yarn.rotary_base ** (ar / dim))
    emb, mscale = YarnRotaryEmbedding.get_emb(yarn, int(position_ids.max()) + 1)
    emb = emb[position_ids[0], 0, 0][None]  # [1, s, dim]
    return (torch.cos(emb) * mscale).to(x.dtype), (torch.sin(emb) * mscale).to(x.dtype)


def run_hf(net, input_ids, labels, model: dict, loss_dtype=None):
    """Forward (labels as given: already shifted), masked-mean CE, backward; canonical outputs and gradients."""
    out, handles = {}, []
    layers = model["num_hidden_layers"]
    dense = model["first_k_dense_replace"]

    def keep(name):
        def hook(module, args, output):
            out[f"module.{name}"] = (output[0] if isinstance(output, tuple) else output).detach()[0]
        return hook

    def keep_input(name):
        def hook(module, args):
            out[f"module.{name}"] = args[0].detach()[0]
        return hook

    def register(module, name, pre=False):
        handles.append(module.register_forward_pre_hook(keep_input(name)) if pre else
                       module.register_forward_hook(keep(name)))

    register(net.model.embed_tokens, "model.embed_tokens")
    register(net.model.norm, "model.norm")
    for L in range(layers):
        layer, p = net.model.layers[L], f"model.layers.{L}"
        register(layer, p)
        register(layer.input_layernorm, f"{p}.input_layernorm")
        register(layer.post_attention_layernorm, f"{p}.post_attention_layernorm")
        a = layer.self_attn
        for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                  "o_proj"):
            register(getattr(a, n), f"{p}.self_attn.{n}")
        register(a.o_proj, f"{p}.self_attn.core_attention", pre=True)
        if L < dense:
            register(layer.mlp.gate_proj, f"{p}.mlp._gate")
            register(layer.mlp.up_proj, f"{p}.mlp._up")
            register(layer.mlp.down_proj, f"{p}.mlp.act", pre=True)
            register(layer.mlp.down_proj, f"{p}.mlp.down_proj")
        else:
            register(layer.mlp, f"{p}.mlp")
            register(layer.mlp.shared_experts, f"{p}.mlp.shared_experts")
            moe = layer.mlp

            def route_hook(moe, p=p):
                original = moe.route_tokens_to_experts

                def wrapped(logits):
                    idx, w = original(logits)
                    probs = torch.zeros(logits.shape[0], moe.n_routed_experts, dtype=w.dtype)
                    probs.scatter_(1, idx, w)
                    out[f"module.{p}.mlp.gate.topk_indices"] = torch.sort(idx, dim=-1).values
                    out[f"module.{p}.mlp.gate.probs"] = probs.detach()
                    return idx, w
                moe.route_tokens_to_experts = wrapped
            route_hook(moe)
    try:
        logits = net(input_ids=input_ids.view(1, -1)).logits[0]
        ce_logits = logits if loss_dtype is None else logits.to(loss_dtype)
        mask = labels != -100
        per_token = F.cross_entropy(ce_logits, torch.where(mask, labels, 0), reduction="none")
        loss = (per_token * mask.to(per_token.dtype)).sum() / mask.sum()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        for layer in net.model.layers:
            layer.mlp.__dict__.pop("route_tokens_to_experts", None)
    out["loss"], out["logits"] = loss.detach(), logits.detach()
    for L in range(dense):
        p = f"module.model.layers.{L}.mlp"
        out[f"{p}.gate_up_proj"] = torch.cat([out.pop(f"{p}._gate"), out.pop(f"{p}._up")], dim=-1)
    for name, param in net.named_parameters():
        g = param.grad
        if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:
            prefix, kind = name.rsplit(".", 1)
            for e in range(g.shape[0]):
                out[f"grad.{prefix}.{e}.{kind}.weight"] = g[e]
        elif name.endswith(".gate_proj.weight"):
            up = dict(net.named_parameters())[name.replace("gate_proj", "up_proj")].grad
            out[f"grad.{name.replace('gate_proj', 'gate_up_proj')}"] = torch.cat([g, up], dim=0)
        elif not name.endswith(".up_proj.weight"):
            out[f"grad.{name}"] = g
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (normwise: elementwise relative errors explode where values cancel to ~0)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def group_of(name: str) -> str:
    if name in ("loss", "logits"):
        return name
    kind, rest = name.split(".", 1)
    for key in ("self_attn", "mlp.experts", "mlp.gate.", "mlp.shared_experts", "layernorm", "embed", "norm",
                "lm_head", "mlp"):
        if key in rest:
            return f"{kind}:{key}"
    return f"{kind}:other"
