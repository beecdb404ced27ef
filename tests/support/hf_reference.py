"""HF transformers' DeepseekV3ForCausalLM (torch, CPU) as the reference for the model-runner tests: canonical module
outputs (hooks) and gradients (docs/model-contract.md) on the case the runner got.

In the test's process (tests/test_megatron_model.py): ``run_hf`` on the model ``deepseek_v3_builder.hf_init_case``
built; ``lift_hf_fp32_islands`` patches, for the duration of a ``with``, the places where HF computes in float32
whatever the model dtype (RMSNorm, router logits), so that a float64 HF model computes in float64 except its float32
RoPE table; ``megatron_islands=True`` adds the float32 islands Megatron forces (sigmoid of the router logits, the RoPE
table formula), so that the remaining difference is the mapping alone.

As a process of its own (tests/test_paddle_model.py), on a request's checkpoint, HF's own loss path
(``ForCausalLMLoss``, given the already shifted labels as ``shift_labels``)::

    python -m tests.support.hf_reference REQUEST.json OUT.safetensors

torch and transformers are imported inside the functions, never by importing this module: PaddleFormers, imported
into a process where torch is not, imports transformers with torch hidden (paddleformers/__init__.py), so HF's torch
models are missing there; a torch imported before it changes what PaddleFormers gets instead. The Paddle tests
therefore run this module in a process of its own.

Per-expert outputs are not modules in HF's fused experts, so they are not captured; the router's top-k is, by
wrapping ``route_tokens_to_experts`` (a method, not a module); routed-expert gradients are slices of HF's fused 3-D
parameters.
"""

from __future__ import annotations

import contextlib
import json
import sys


def hf_model(config: dict, attn: str, seed: int = 0):
    """A DeepseekV3ForCausalLM for a case's model config, HF's own init after ``torch.manual_seed(seed)``, experts
    eager (float32: the caller casts)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta", "scoring_func", "topk_method")}
    rope = dict(config["rope_scaling"])
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = config["rope_theta"]
    hf_config = DeepseekV3Config(**kwargs, rope_parameters=rope, rope_interleave=True, attn_implementation=attn,
                                 experts_implementation="eager")
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(hf_config)


def load_request(request: dict):
    """The HF model (attention eager) with the request's checkpoint in it, in the request's dtype; its input_ids
    and labels."""
    import torch
    from safetensors.torch import load_file

    config = request["config"]["model"]
    model = hf_model(config, attn="eager").to({"float32": torch.float32, "float64": torch.float64}[request["dtype"]])
    tensors = load_file(request["checkpoint"])
    state = {}
    experts = config["n_routed_experts"]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "0.gate_proj.weight" in tensors:
            state[p + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(p + f"{e}.gate_proj.weight"),
                                                                tensors.pop(p + f"{e}.up_proj.weight")], 0)
                                                     for e in range(experts)])
            state[p + "down_proj"] = torch.stack([tensors.pop(p + f"{e}.down_proj.weight") for e in range(experts)])
    ids, labels = tensors.pop("input_ids"), tensors.pop("labels")
    state.update(tensors)
    model_state = model.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            model_state[name].copy_(value.to(model_state[name].dtype))
    missing = set(n for n in model_state if not n.endswith("inv_freq")) - set(state)
    assert not missing, missing
    return model, ids, labels


@contextlib.contextmanager
def lift_hf_fp32_islands(megatron_islands: bool = False):
    import torch
    import torch.nn.functional as F
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
    import torch

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
    import torch
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


@contextlib.contextmanager
def captured_outputs(net, model: dict):
    """Canonical module outputs (the batch dimension dropped) into the dict it yields, while the `with` lasts."""
    import torch

    out, handles = {}, []
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
    for L in range(model["num_hidden_layers"]):
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
        yield out
    finally:
        for h in handles:
            h.remove()
        for layer in net.model.layers:
            layer.mlp.__dict__.pop("route_tokens_to_experts", None)
    for L in range(dense):
        p = f"module.model.layers.{L}.mlp"
        out[f"{p}.gate_up_proj"] = torch.cat([out.pop(f"{p}._gate"), out.pop(f"{p}._up")], dim=-1)


def gradients(net) -> dict:
    """Every parameter's gradient by its contract name (gate and up projections concatenated, experts sliced)."""
    import torch

    out = {}
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


def run_hf(net, input_ids, labels, model: dict, loss_dtype=None):
    """Forward (labels as given: already shifted), masked-mean CE, backward; canonical outputs and gradients."""
    import torch
    import torch.nn.functional as F

    with captured_outputs(net, model) as out:
        logits = net(input_ids=input_ids.view(1, -1)).logits[0]
        ce_logits = logits if loss_dtype is None else logits.to(loss_dtype)
        mask = labels != -100
        per_token = F.cross_entropy(ce_logits, torch.where(mask, labels, 0), reduction="none")
        loss = (per_token * mask.to(per_token.dtype)).sum() / mask.sum()
        loss.backward()
    out["loss"], out["logits"] = loss.detach(), logits.detach()
    return {**out, **gradients(net)}


def run_request(request: dict, out_path: str) -> None:
    """The request's case through HF with HF's own loss (ForCausalLMLoss); outputs and gradients as safetensors."""
    from safetensors.numpy import save_file

    model, ids, labels = load_request(request)
    model.train()
    with captured_outputs(model, request["config"]["model"]) as out:
        logits = model(input_ids=ids.reshape(1, -1)).logits
        loss = model.loss_function(logits, None, vocab_size=model.config.vocab_size,
                                   shift_labels=labels.reshape(1, -1))
        loss.backward()
    out["logits"], out["loss"] = logits.detach()[0], loss.detach().reshape(())
    tensors = {**out, **gradients(model)}
    save_file({k: v.numpy().copy() for k, v in tensors.items()}, out_path)


def relative_error(a, b) -> float:
    """max |a - b| / max |b| of two torch tensors (normwise: elementwise relative errors explode where values
    cancel to ~0)."""
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


if __name__ == "__main__":
    run_request(json.loads(open(sys.argv[1]).read()), sys.argv[2])
