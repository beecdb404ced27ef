"""HF transformers runner for model cases (op ``causal_lm``, docs/model-contract.md): imports torch + transformers.

The model is transformers' own class for the case's family (DeepSeek-V3's ``DeepseekV3ForCausalLM``), built by the
hf room (``hf_families.py``, from the family's data) from the request's ``config.model`` (every value given, none left
to transformers' defaults) and loaded from the canonical checkpoint through the name map's ``[hf.checkpoint]`` table:
transformers 5 fuses a MoE layer's routed experts into ``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` (gate rows first:
its forward is ``linear(x, gate_up_proj[e]).chunk(2)``) and ``mlp.experts.down_proj`` ``[E, H, F]``, so the per-expert
checkpoint tensors are stacked into them, and the per-expert canonical gradients are slices of their ``.grad``. One
forward with ``input_ids``, HF's LM loss (``ForCausalLMLoss`` with ``shift_labels``: the checkpoint's labels are
already shifted), ``loss.backward()``; module outputs and gradients go through ``harness.capture.torch``.

Knobs, each chosen on purpose and written to meta.json: eager attention (matmul + float32 softmax, HF's reference
path; sdpa would pick a CPU kernel by shape), eager experts (a loop of per-expert ``F.linear``; HF's default is
``grouped_mm`` where torch offers it), train mode, no KV cache, the family's buffers (the routing bias) kept in float32
(HF's ``_keep_in_fp32_modules_strict``), TorchDynamo off; the family's own (``[knobs]`` of its ``hf.toml``).

Float64 (the truth and the semantic check): HF computes some things in float32 whatever the model's dtype; in a
float64 request the family's ``float64_mode`` replaces exactly those with the same formulas in float64 (listed in
meta.json under ``float64_mode``) and puts HF's own back when the cell ends.

A request whose dtype is wider than the checkpoint's (the float64 truth of a bf16 case) upcasts the weights,
which is exact.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harness.capture import EXPERT_WHY, REFEED_FILE, refeed_units  # noqa: E402
from harness.capture.rows import first_sequence_only  # noqa: E402
from harness.capture.torch import Refeed, capture  # noqa: E402
from harness.case.ops import OPS  # noqa: E402
from harness.families import model_config  # noqa: E402
from harness.families.names import NameMap, expand_stack  # noqa: E402
from harness.run.protocol import OUTPUTS, Phases, Unsupported  # noqa: E402
from harness.runners.torch import env as torch_env  # noqa: E402
from harness.runners.torch import hf_families  # noqa: E402

# taken from route_tokens_to_experts' return value, and from a DSA indexer's (hf_families.record_selection)
RECORDED = (".mlp.gate.topk_indices", ".mlp.gate.probs", ".indexer.selected")
KNOBS = {
    "attn_implementation": ("eager", "HF's reference attention: matmul, additive causal mask, float32 softmax; "
                                     "sdpa would choose a CPU/GPU kernel by shape"),
    "experts_implementation": ("eager", "a loop of per-expert F.linear over the tokens routed to each expert; HF's "
                                        "default is grouped_mm where torch offers it"),
    "training": (True, "a training step (the model has no dropout: attention_dropout 0)"),
    "use_cache": (False, "no KV cache in a training step"),
    "loss": ("ForCausalLMLoss(shift_labels=labels)", "HF's own LM loss; the checkpoint's labels are already "
                                                     "shifted (labels[t] = input_ids[t + 1], -100 at the end)"),
    "TORCHDYNAMO_DISABLE": (os.environ.get("TORCHDYNAMO_DISABLE"), "eager numerics, no torch.compile"),
}


def run(request: dict, phases: Phases) -> dict:
    if request["op"] != "causal_lm":
        raise Unsupported(f"whole models only (op causal_lm), not {request['op']!r}")
    if request["tp"] != 1:
        raise Unsupported(f"one device only (tp=1), got tp={request['tp']}")
    m = model_config(request["config"]["model"])  # the family resolved once, passed typed
    with phases("import"):
        hf = hf_families.modeling(m)
    with hf_families.float64_mode(hf, m, on=request["dtype"] == "float64") as replaced:
        return _run(request, phases, m, hf, replaced)


def _run(request: dict, phases: Phases, m, hf, float64_replaced: dict) -> dict:
    import transformers

    dtype = torch_env.DTYPES[request["dtype"]]
    name_map = NameMap.load(m.family, "hf", model=m)
    outputs = OPS["causal_lm"].outputs({}, request["tokens"], request["config"])
    with phases("setup"):
        device = torch_env.select_device(request["device"])
        determinism = torch_env.apply_determinism(device)
        checkpoint = torch_env.load_inputs(request["checkpoint"], device)
        model = build_model(hf, m, dtype, device, checkpoint, name_map)
        ids, labels = torch_env.sequences(checkpoint["input_ids"]), torch_env.sequences(checkpoint["labels"])
        padding = checkpoint.get("attention_mask")  # --versus pad: the first sequence right-padded, pads masked
        gates = hf_families.record_routing(model, hf, m)
        selected = hf_families.record_selection(model, m)
    modules = [s.name[len("module."):] for s in outputs if s.name.startswith("module.")
               and not s.name.endswith(RECORDED)]
    grads = [s.name[len("grad."):] for s in outputs if s.name.startswith("grad.")]
    chunk = request["config"].get("kv_cache_chunk")
    if chunk:  # --versus cache: a forward only, `chunk` tokens at a time through the cache
        return _through_cache(request, phases, model, ids, labels, m, hf, chunk, determinism, device)
    refeed_request = request["config"].get("refeed")
    with capture(model, None, name_map=name_map, modules=modules, grads=grads) as cap:
        refeed = None
        if refeed_request:  # after capture: its hooks see the local tensors
            units, not_refed = refeed_units(modules, lambda n: name_map.rule("modules", n, m),
                                            extra={"lm_head": ["lm_head"]}, skip={r"\.experts\.\d+$": EXPERT_WHY})
            refeed = Refeed(model, units, refeed_request["mode"], refeed_request.get("from"), batch_dim=0)
        with phases("forward"):
            logits = model(input_ids=ids, attention_mask=padding, use_cache=False).logits
            loss = lm_loss(model, logits, labels, m, dtype)
            torch_env.synchronize(device)
        with phases("backward"):
            loss.backward()
            torch_env.synchronize(device)
        cap.record("loss", loss)
        cap.record("logits", logits[0, :request["tokens"]])  # the first sequence's (under --versus batch or pad)
        refeed_tensors = refeed.finish() if refeed else {}
        for layer, (indices, weights) in gates.items():
            topk, probs = canonical_routing(indices, weights, m.record.routed_experts(m))
            cap.record(f"module.model.layers.{layer}.mlp.gate.topk_indices", topk)
            cap.record(f"module.model.layers.{layer}.mlp.gate.probs", probs)
    batch_blind = first_sequence_only(cap.tensors, ids.shape[0], ids.shape[1], sequence_first=False,
                                      keep=request["tokens"])
    shapes = {s.name: s.shape for s in outputs}  # the recorder keeps the first sequence's selection: cut to its own
    for name, keys in selected.items():
        rows, columns = shapes["module." + name]
        cap.record("module." + name, keys[:rows, :columns])
    with phases("write"):
        save_file(cap.tensors, os.path.join(request["output_dir"], OUTPUTS))
        if refeed:
            save_file(refeed_tensors, os.path.join(request["output_dir"], REFEED_FILE))
    refeed_meta = {"refeed": {**refeed.meta(), "units": list(units),
                              "not_refed": {**group_by_expert(not_refed), **refeed.not_refed}}} if refeed else {}
    return {**refeed_meta,
        "framework": "pytorch", "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "implementation": f"{hf.__name__}.{hf_families.model_class(m)} (HF transformers, torch), attention "
                          f"{model.config._attn_implementation}, experts {model.config._experts_implementation}",
        "adapters": [],
        "knobs": {k: {"value": v, "why": why} for k, (v, why) in {**KNOBS, **hf_families.knobs(m)}.items()},
        "float64_mode": float64_replaced,
        "not_captured": group_by_expert({**cap.not_captured, **batch_blind}),
        "sequences": int(ids.shape[0]),
        "zero_grads": cap.zero_grads,
        "routing": {f"layer {layer}": {"experts_with_tokens": int(torch.unique(idx).numel())}
                    for layer, (idx, _) in gates.items()},
        "determinism": determinism, **torch_env.provenance(device),
    }


def lm_loss(model, logits: torch.Tensor, labels: torch.Tensor, m, dtype: torch.dtype) -> torch.Tensor:
    """HF's LM loss; in float64 the same loss without its upcast to float32 first."""
    if dtype == torch.float64:
        from transformers.loss.loss_utils import fixed_cross_entropy
        return fixed_cross_entropy(logits.view(-1, m.vocab_size), labels.view(-1))
    return model.loss_function(logits=logits, labels=None, vocab_size=m.vocab_size, shift_labels=labels)


def _through_cache(request: dict, phases: Phases, model, ids, labels, m, hf, chunk: int, determinism: dict,
                   device) -> dict:
    """The sequence's logits and loss from prefilling `chunk` tokens, then `chunk` more at a time, through the
    model's own KV cache (``DynamicCache``): what a decoder serving it computes, to set against one pass."""
    import transformers

    cache, parts = transformers.DynamicCache(config=model.config), []
    with phases("forward"), torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            parts.append(model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True).logits)
        logits = torch.cat(parts, dim=1)
        loss = lm_loss(model, logits, labels, m, torch_env.DTYPES[request["dtype"]])
        torch_env.synchronize(device)
    with phases("write"):
        save_file({"logits": logits[0].contiguous(), "loss": loss}, os.path.join(request["output_dir"], OUTPUTS))
    knobs = {**KNOBS, **hf_families.knobs(m), "use_cache": (True, f"--versus cache: {chunk} tokens a pass through "
                                                                   "DynamicCache, forward only (no gradients)")}
    return {"framework": "pytorch", "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "implementation": f"{hf.__name__}.{hf_families.model_class(m)} (HF transformers, torch), "
                              f"{-(-ids.shape[1] // chunk)} passes through its KV cache",
            "adapters": [], "knobs": {k: {"value": v, "why": why} for k, (v, why) in knobs.items()},
            "kv_cache": {"chunk": chunk, "passes": -(-ids.shape[1] // chunk)},
            "determinism": determinism, **torch_env.provenance(device)}


def build_model(hf, m, dtype: torch.dtype, device, checkpoint: dict, name_map: NameMap):
    """The family's model from the case's config (`m`: the request's config.model, or typed), every parameter and
    buffer from the checkpoint, in train mode (also the training runner's model: harness.runners.torch.hf_train)."""
    m = model_config(m)
    model, config = hf_families.build(hf, m)
    buffers = {name for name, _ in m.record.buffers(m)}
    model.load_state_dict(_state_dict(model, checkpoint, name_map, m, dtype, buffers), strict=True, assign=True)
    hf_families.rotary(model, hf, m, config, device, dtype)
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


def _state_dict(model, checkpoint: dict, name_map: NameMap, m, dtype: torch.dtype, buffers: set[str]) -> dict:
    """Every parameter and persistent buffer of the HF model, built from canonical tensors by the name map; the
    family's `buffers` in float32 (float64 in a float64 run), an integer table as it is."""
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
        if not tensor.is_floating_point():  # an integer table (DeepSeek-V4's tid2eid) as it is
            keep = tensor.dtype
        elif name not in buffers:
            keep = dtype
        state[name] = tensor.to(keep).contiguous()
    return state


def canonical_routing(indices: torch.Tensor, weights: torch.Tensor, experts: int):
    """topk_indices with each row ascending, and probs [T, E]: the weights at their experts, zero elsewhere
    (a permutation and a scatter: exact)."""
    ordered, _ = indices.sort(dim=-1)
    probs = torch.zeros(indices.shape[0], experts, dtype=weights.dtype, device=weights.device)
    return ordered, probs.scatter(1, indices, weights)
