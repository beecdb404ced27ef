"""HF transformers runner for model cases (op ``causal_lm``, docs/model-contract.md): imports torch + transformers.

The model is transformers' own ``DeepseekV3ForCausalLM`` (read and pinned: transformers 5.3.0), built from the
request's ``config.model`` (every value given, none left to transformers' defaults) and loaded from the canonical
checkpoint through the name map's ``[hf.checkpoint]`` table: transformers 5 fuses a MoE layer's routed experts into
``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` (gate rows first: its forward is ``linear(x, gate_up_proj[e]).chunk(2)``)
and ``mlp.experts.down_proj`` ``[E, H, F]``, so the per-expert checkpoint tensors are stacked into them, and the
per-expert canonical gradients are slices of their ``.grad``. One forward with ``input_ids``, HF's LM loss
(``ForCausalLMLoss`` with ``shift_labels``: the checkpoint's labels are already shifted), ``loss.backward()``;
module outputs and gradients go through ``harness.capture.torch``.

Knobs, each chosen on purpose and written to meta.json: eager attention (matmul + float32 softmax, HF's reference
path; sdpa would pick a CPU kernel by shape), eager experts (a loop of per-expert ``F.linear``; HF's default is
``grouped_mm`` where torch offers it), train mode, no KV cache, ``e_score_correction_bias`` kept in float32 (HF's
``_keep_in_fp32_modules_strict``), TorchDynamo off.

Float64 (the truth and the semantic check): HF computes RMSNorm, the router GEMM, the RoPE tables, the attention
softmax and the loss in float32 whatever the model's dtype. In a float64 request the runner replaces exactly those
five places with the same formulas in float64 (listed in meta.json under ``float64_mode``); nothing else changes,
and nothing changes at all for bfloat16 and float32. Three of them are class and module attributes of transformers:
``float64_mode`` puts HF's own back when the cell ends, so a worker's next cell runs HF's code.

A request whose dtype is wider than the checkpoint's (the float64 truth of a bf16 case) upcasts the weights,
which is exact.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harness.capture import EXPERT_WHY, REFEED_FILE, refeed_units  # noqa: E402
from harness.capture.torch import Refeed, capture  # noqa: E402
from harness.case.models import NameMap, expand_stack, moe_layers  # noqa: E402
from harness.case.ops import OPS  # noqa: E402
from harness.run.cell_state import attribute_restored  # noqa: E402
from harness.run.protocol import OUTPUTS, Phases, Unsupported  # noqa: E402
from harness.runners.torch import env as torch_env  # noqa: E402

RECORDED = (".mlp.gate.topk_indices", ".mlp.gate.probs")  # taken from route_tokens_to_experts' return value
KNOBS = {
    "attn_implementation": ("eager", "HF's reference attention: matmul, additive causal mask, float32 softmax; "
                                     "sdpa would choose a CPU/GPU kernel by shape"),
    "experts_implementation": ("eager", "a loop of per-expert F.linear over the tokens routed to each expert; HF's "
                                        "default is grouped_mm where torch offers it"),
    "training": (True, "a training step (the model has no dropout: attention_dropout 0)"),
    "use_cache": (False, "no KV cache in a training step"),
    "e_score_correction_bias": ("float32", "HF keeps it in float32 (_keep_in_fp32_modules_strict); float64 in a "
                                          "float64 run"),
    "loss": ("ForCausalLMLoss(shift_labels=labels)", "HF's own LM loss; the checkpoint's labels are already "
                                                     "shifted (labels[t] = input_ids[t + 1], -100 at the end)"),
    "TORCHDYNAMO_DISABLE": (os.environ.get("TORCHDYNAMO_DISABLE"), "eager numerics, no torch.compile"),
}


def run(request: dict, phases: Phases) -> dict:
    if request["op"] != "causal_lm":
        raise Unsupported(f"hf_model runs whole models (op causal_lm), not {request['op']!r}")
    if request["tp"] != 1:
        raise Unsupported(f"hf_model runs on one device (tp=1), got tp={request['tp']}")
    with phases("import"):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
    with float64_mode(hf, on=request["dtype"] == "float64") as replaced:
        return _run(request, phases, hf, replaced)


def _run(request: dict, phases: Phases, hf, float64_replaced: dict) -> dict:
    import transformers

    m = request["config"]["model"]
    dtype = torch_env.DTYPES[request["dtype"]]
    name_map = NameMap.load(m["family"], "hf")
    outputs = OPS["causal_lm"].outputs({}, request["tokens"], request["config"])
    with phases("setup"):
        device = torch_env.select_device(request["device"])
        determinism = torch_env.apply_determinism(device)
        checkpoint = torch_env.load_inputs(request["checkpoint"], device)
        model = build_model(hf, m, dtype, device, checkpoint, name_map)
        ids = checkpoint["input_ids"].view(1, -1)
        labels = checkpoint["labels"].view(1, -1)
        gates = {}
        for layer in moe_layers(m):
            _record_routing(model.model.layers[layer].mlp, layer, gates)
    modules = [s.name[len("module."):] for s in outputs if s.name.startswith("module.")
               and not s.name.endswith(RECORDED)]
    grads = [s.name[len("grad."):] for s in outputs if s.name.startswith("grad.")]
    refeed_request = request["config"].get("refeed")
    with capture(model, None, name_map=name_map, modules=modules, grads=grads) as cap:
        refeed = None
        if refeed_request:  # after capture: its hooks see the local tensors
            units, not_refed = refeed_units(modules, lambda n: name_map.rule("modules", n, m),
                                            extra={"lm_head": ["lm_head"]}, skip={r"\.experts\.\d+$": EXPERT_WHY})
            refeed = Refeed(model, units, refeed_request["mode"], refeed_request.get("from"), batch_dim=0)
        with phases("forward"):
            logits = model(input_ids=ids, use_cache=False).logits
            if dtype == torch.float64:  # HF's ForCausalLMLoss upcasts to float32 first; the same loss without that
                from transformers.loss.loss_utils import fixed_cross_entropy
                loss = fixed_cross_entropy(logits.view(-1, m["vocab_size"]), labels.view(-1))
            else:
                loss = model.loss_function(logits=logits, labels=None, vocab_size=m["vocab_size"],
                                           shift_labels=labels)
            torch_env.synchronize(device)
        with phases("backward"):
            loss.backward()
            torch_env.synchronize(device)
        cap.record("loss", loss)
        cap.record("logits", logits[0])
        refeed_tensors = refeed.finish() if refeed else {}
        for layer, (indices, weights) in gates.items():
            topk, probs = canonical_routing(indices, weights, m["n_routed_experts"])
            cap.record(f"module.model.layers.{layer}.mlp.gate.topk_indices", topk)
            cap.record(f"module.model.layers.{layer}.mlp.gate.probs", probs)
    with phases("write"):
        save_file(cap.tensors, os.path.join(request["output_dir"], OUTPUTS))
        if refeed:
            save_file(refeed_tensors, os.path.join(request["output_dir"], REFEED_FILE))
    refeed_meta = {"refeed": {**refeed.meta(), "units": list(units),
                              "not_refed": {**group_by_expert(not_refed), **refeed.not_refed}}} if refeed else {}
    return {**refeed_meta,
        "framework": "pytorch", "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "implementation": f"{hf.__name__}.DeepseekV3ForCausalLM (HF transformers, torch), attention "
                          f"{model.config._attn_implementation}, experts {model.config._experts_implementation}",
        "adapters": [],
        "knobs": {k: {"value": v, "why": why} for k, (v, why) in KNOBS.items()},
        "float64_mode": float64_replaced,
        "not_captured": group_by_expert(cap.not_captured),
        "zero_grads": cap.zero_grads,
        "routing": {f"layer {layer}": {"experts_with_tokens": int(torch.unique(idx).numel())}
                    for layer, (idx, _) in gates.items()},
        "determinism": determinism, **torch_env.provenance(device),
    }


def build_model(hf, m: dict, dtype: torch.dtype, device, checkpoint: dict, name_map: NameMap):
    """DeepseekV3ForCausalLM from the case's config, every parameter and buffer from the checkpoint, in train mode
    (also the training runner's model: harness.runners.torch.hf_train)."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        model = hf.DeepseekV3ForCausalLM(config)
    model.load_state_dict(_state_dict(model, checkpoint, name_map, m, dtype), strict=True, assign=True)
    model.model.rotary_emb = hf.DeepseekV3RotaryEmbedding(config=config, device=device)
    if dtype == torch.float64:
        _rotary_in_float64(model.model.rotary_emb, config)
    model.train()
    for param in model.parameters():
        param.requires_grad_(True)
    leftover = [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise RuntimeError(f"buffers left on the meta device: {leftover}")
    return model


def group_by_expert(names: dict[str, str]) -> dict[str, str]:
    """{name: why} with the per-expert names folded into one `{E}` pattern (name-map syntax) each."""
    return {re.sub(r"\.experts\.\d+(?=\.|$)", ".experts.{E}", name): why for name, why in names.items()}


def hf_config(m: dict, hf):
    """DeepseekV3Config from the case's resolved config (HF key names; rope_scaling becomes rope_parameters)."""
    scaling = m["rope_scaling"]
    rope = {"rope_type": scaling["type"], "rope_theta": m["rope_theta"], "factor": scaling["factor"],
            "original_max_position_embeddings": scaling["original_max_position_embeddings"],
            "beta_fast": scaling["beta_fast"], "beta_slow": scaling["beta_slow"], "mscale": scaling["mscale"],
            "mscale_all_dim": scaling["mscale_all_dim"]}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
            "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "attention_bias", "rope_interleave")
    # scoring_func = sigmoid and topk_method = noaux_tc are what DeepseekV3MoE hard-codes (the registry allows no other)
    return hf.DeepseekV3Config(**{k: m[k] for k in keys}, rope_parameters=rope, attention_dropout=0.0,
                               use_cache=False, pad_token_id=None, attn_implementation="eager",
                               experts_implementation="eager")


def _state_dict(model, checkpoint: dict, name_map: NameMap, m: dict, dtype: torch.dtype) -> dict:
    """Every parameter and persistent buffer of the HF model, built from canonical tensors by the name map."""
    state = {}
    for name in model.state_dict():
        rule = name_map.rule("checkpoint", name, m)
        if rule.kind == "same":
            tensor = checkpoint[rule.sources[0]]
        elif rule.kind == "stack":
            tensor = torch.stack([checkpoint[names[0]] for names in expand_stack(rule)])
        elif rule.kind == "stack_cat0":
            tensor = torch.stack([torch.cat([checkpoint[n] for n in names], dim=0) for names in expand_stack(rule)])
        else:
            raise ValueError(f"[hf.checkpoint] {name}: rule {rule.kind} does not load weights")
        keep = torch.float64 if dtype == torch.float64 else torch.float32
        state[name] = tensor.to(keep if name.endswith("e_score_correction_bias") else dtype).contiguous()
    return state


def _record_routing(moe, layer: int, gates: dict) -> None:
    """Keep what route_tokens_to_experts returns (the top-k indices and scaled weights), unchanged."""
    original = moe.route_tokens_to_experts

    def routed(router_logits):
        indices, weights = original(router_logits)
        gates[layer] = (indices.detach().clone(), weights.detach().clone())
        return indices, weights

    moe.route_tokens_to_experts = routed


def canonical_routing(indices: torch.Tensor, weights: torch.Tensor, experts: int):
    """topk_indices with each row ascending, and probs [T, E]: the weights at their experts, zero elsewhere
    (a permutation and a scatter: exact)."""
    ordered, _ = indices.sort(dim=-1)
    probs = torch.zeros(indices.shape[0], experts, dtype=weights.dtype, device=weights.device)
    return ordered, probs.scatter(1, indices, weights)


# --- float64 mode: the five places HF computes in float32 whatever the model's dtype ---------------------------------

@contextmanager
def float64_mode(hf, on: bool = True) -> Iterator[dict]:
    """Inside: HF's RMSNorm, router and eager attention compute in float64 (when `on`); yields {what: how} for
    meta.json ({} when off). They are class and module attributes, so the originals are put back when the block
    ends, however it ends: the next cell of a worker gets HF's own code (tests/test_worker_state.py)."""
    if not on:
        yield {}
        return
    with attribute_restored(hf.DeepseekV3RMSNorm, "forward"), attribute_restored(hf.DeepseekV3TopkRouter, "forward"), \
            attribute_restored(hf, "eager_attention_forward"):
        yield _replace_float32_islands(hf)


def _replace_float32_islands(hf) -> dict:
    def rms_norm(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float64)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def router(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.config.hidden_size)
        return F.linear(hidden_states.type(torch.float64), self.weight.type(torch.float64))

    def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = hf.repeat_kv(key, module.num_key_value_groups)
        value_states = hf.repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float64).to(query.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return attn_output, attn_weights

    hf.DeepseekV3RMSNorm.forward = rms_norm
    hf.DeepseekV3TopkRouter.forward = router
    hf.eager_attention_forward = eager_attention
    return {
        "DeepseekV3RMSNorm.forward": "normalises in float64 (HF: float32)",
        "DeepseekV3TopkRouter.forward": "router GEMM in float64 (HF: float32)",
        "DeepseekV3RotaryEmbedding": "YaRN inverse frequencies and cos/sin tables in float64 (HF: float32)",
        "eager_attention_forward": "softmax in float64 (HF: float32)",
        "loss": "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 first)",
    }


def yarn_inv_freq(config, dtype=torch.float64) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters (5.3.0), the same formula, in `dtype`."""
    rp = config.rope_parameters
    base, dim, factor = rp["rope_theta"], config.qk_rope_head_dim, rp["factor"]
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rp.get("attention_factor") or (
        float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)) if mscale and mscale_all_dim
        else get_mscale(factor))
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
    original = rp["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def _rotary_in_float64(rotary, config) -> None:
    inv_freq, rotary.attention_scaling = yarn_inv_freq(config)
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)

    def forward(x, position_ids):
        inv = rotary.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = forward
