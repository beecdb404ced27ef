"""Megatron-Core model runner (op ``causal_lm``): ``GPTModel`` with the local spec (no Transformer Engine), for a
model family's config given in its HF key names (``docs/model-contract.md``).

The room's one builder for every family (``harness.runners.megatron.families``) translates the HF config to
Megatron's (``translate_config``) and gives the layers the modules the family's architecture needs; the HF-named
checkpoint is loaded through the ``[megatron]`` section of the family's ``names.toml`` (``name_map``); the forward
runs with labels so that Megatron's own LM-loss path computes the per-token cross entropy, and the loss is its mean
over the positions whose label is not -100 (Megatron's ``loss_mask`` convention). Module outputs come from forward
hooks (``capture``), parameter gradients from ``param.grad``, all written in canonical names with the batch dim
dropped.

Adapters (each listed in meta.json, none changes a computation; ``tests/test_megatron_model.py`` tests each): the
family's own first (``harness.runners.megatron.families``: DeepSeek-V3's ``MLADotProductAttention``,
``mla_have_te_false``), then
- CPU only: ``torch.cuda.current_device`` returns ``"cpu"`` (YaRN RoPE, router buffers and the global memory buffer
  ask for the "current GPU"); the RNG tracker is initialised without CUDA (``DotProductAttention`` forks it
  around a dropout of p=0); 0.16.1's ``moe_utils.te_general_gemm`` is defined as None without TE.
The causal mask is passed explicitly (``get_default_causal_mask`` hard-codes CUDA): input, not an adapter.
"""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import tomllib

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # jit_fuser is torch.compile: keep eager numerics

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harness.capture.rows import first_sequence, first_sequence_only  # noqa: E402
from harness.families import model_config  # noqa: E402
from harness.run.cell_state import patch  # noqa: E402
from harness.run.protocol import (  # noqa: E402
    OUTPUTS,
    Phases,
    Unsupported,
    import_failure,
    rank_and_world,
)
from harness.runners.megatron import dsa, families, gdn  # noqa: E402
from harness.runners.torch import env as torch_env  # noqa: E402

try:
    from megatron.core import __version__ as megatron_version
    from megatron.core import parallel_state, tensor_parallel
except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR (in run)
    MEGATRON_IMPORT_ERROR: Exception | None = error
else:
    MEGATRON_IMPORT_ERROR = None

DTYPES = {**torch_env.DTYPES, "float64": torch.float64}
IGNORE_INDEX = -100


ADAPTER_DOCS = {
    "cpu_current_device": "CPU only: torch.cuda.current_device() returns 'cpu' (YarnRotaryEmbedding, TopKRouter "
    "buffers and the global memory buffer ask for the current GPU)",
    "cpu_rng_tracker": "CPU only: tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True) instead "
    "of model_parallel_cuda_manual_seed (DotProductAttention forks the CUDA RNG tracker around dropout p=0)",
    "te_general_gemm_none": "megatron-core < 0.19 without Transformer Engine: moe_utils.te_general_gemm = None "
    "(the router references the name unguarded)",
}


def install_adapters(device: torch.device, model, skip=()) -> list[dict]:
    """The shims (the family's of `model`, then the CPU ones only on a CPU), each returned as a meta.json entry;
    `skip` is for the tests that show each one is needed. Each patch lasts for this cell only
    (``harness.run.cell_state.patch``)."""
    from megatron.core.transformer.moe import moe_utils

    docs = {**families.ADAPTERS, **ADAPTER_DOCS}
    names = families.install_adapters(model_config(model), skip, te_importable())
    if not hasattr(moe_utils, "te_general_gemm") and "te_general_gemm_none" not in skip:
        patch(moe_utils, "te_general_gemm", None)
        names.append("te_general_gemm_none")
    if device.type == "cpu":
        if "cpu_current_device" not in skip:
            patch(torch.cuda, "current_device", lambda: "cpu")
            names.append("cpu_current_device")
        if "cpu_rng_tracker" not in skip:
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            names.append("cpu_rng_tracker")
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return [{"name": n, "why": docs[n], "changes_computation": False} for n in names]


def te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401  (probed only: this runner never uses it)
    except ImportError:
        return False
    return True


def translate_config(model, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """The family's Megatron config for `model` (the request's config.model): (config, knobs: every setting chosen
    and why); `expert_parallel`: the experts split over that many ranks (a training run's train.ep)."""
    return families.translate_config(model_config(model), dtype, device, expert_parallel)


def build_model(config, model, device: torch.device, skip_adapters=()):
    """``GPTModel`` on the local block spec, each layer's spec given the family's modules (``layer_spec``: MLA's
    core attention for DeepSeek-V3) and GPTModel the family's own arguments (``gpt_model_kwargs``: partial rotary)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    model = model_config(model)
    spec = families.decoder_block_spec(model, config, WrappedTorchNorm)
    spec.layer_specs = [copy.deepcopy(s) for s in spec.layer_specs]
    for layer_spec in spec.layer_specs:
        families.layer_spec(model, layer_spec, skip_adapters)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=model.vocab_size,
                     max_sequence_length=int(model.max_position_embeddings), pre_process=True,
                     post_process=True, parallel_output=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", **families.gpt_model_kwargs(model))
    # Every parameter in the case dtype, as Megatron's Float16Module does for bf16 (module.bfloat16()): the local
    # WrappedTorchNorm creates fp32 norm weights. Buffers loaded from the checkpoint keep its dtype (load_weights).
    return model.to(device=device, dtype=config.params_dtype)


# ---------------------------------------------------------------------------------------------- name map

def name_map(model, section: str = "megatron") -> dict:
    """The family's TOML section expanded for `model` (the request's config.model, or typed): {"parameters":
    {canonical: (megatron, [checkpoint names])}, "buffers": {...same...}, "modules": {canonical: megatron},
    "not_captured": {canonical: why}, "parts": {canonical: Rule}}. An entry `{name, cat0 = [...]}` builds the Megatron
    tensor by concatenating checkpoint tensors; `{name, interleave = [...]}` by interleaving them per query group
    (linear_qkv: q, k, v), and each of those canonical tensors (gradient or module output) is then one part of the
    Megatron tensor: "parts" holds the rule that takes it (harness.families.names, kind deinterleave). Only the tensors
    the family's layout has for `model` are kept (e.g. q_layernorm only with use_qk_norm, the qkv bias only with
    attention_bias)."""
    from harness.families.names import Rule, grouping

    model = model_config(model)
    family = model.record
    dense_layers, moe_layers = family.dense_layers(model), family.moe_layers(model)
    experts = family.routed_experts(model)
    data = tomllib.loads(family.names.read_text())[section]
    groups = {"model": [{}], "layer": [{"L": L} for L in sorted(dense_layers + moe_layers)],
              "dense": [{"L": L} for L in dense_layers], "moe": [{"L": L} for L in moe_layers],
              "expert": [{"L": L, "E": E} for L in moe_layers for E in range(experts)]}
    kept = {"parameters": {n[len("grad."):] for n, _ in family.gradients(model)},
            "buffers": {n for n, _ in family.buffers(model)},
            "modules": {s.name[len("module."):] for s in family.modules(model, 1)}}
    kept["not_captured"] = kept["modules"]
    kept["detached"] = set(family.detached(model))
    rows = {n[len("grad."):]: shape[0] for n, shape in family.gradients(model)}
    out, parts, rope_rows, one_plus = {}, {}, {}, set()
    for kind in ("parameters", "detached", "buffers", "modules", "not_captured"):
        table = {}
        for group, entries in data.get(kind, {}).items():
            for group_subst in groups[group]:
                for canonical, target in entries.items():
                    expand = "{E}" in canonical and "E" not in group_subst  # per expert of a layer
                    for subst in ([dict(group_subst, E=E) for E in range(experts)] if expand else [group_subst]):
                        key = canonical.format(**subst)
                        if key not in kept[kind] and not any(k.startswith(key + ".") for k in kept[kind]):
                            continue  # the layout has no such tensor for this config
                        if kind == "not_captured":
                            table[key] = target
                        elif isinstance(target, str):
                            table[key] = target.format(**subst) if kind == "modules" else (target.format(**subst),
                                                                                           [key])
                        else:
                            fused = [n.format(**subst) for n in target.get("cat0") or target.get("interleave")
                                     or [key]]
                            table[key] = target["name"].format(**subst) if kind == "modules" else (
                                target["name"].format(**subst), fused)
                            if "rope_rows" in target:
                                rope_rows[key] = rope_permutation(model, target["rope_rows"])
                            if target.get("gated_rows"):
                                rope_rows[key] = gdn.gated_head_rows(model)
                            if target.get("zero_centred"):
                                one_plus.add(key)
                            if "cat0" in target and key in fused:  # one of the tensors concatenated into `name`
                                widths = tuple(rows[n if kind != "modules" else n + ".weight"] for n in fused)
                                source = table[key] if kind == "modules" else table[key][0]
                                parts[key] = Rule("deinterleave", (source,), fused.index(key), groups=1,
                                                  widths=widths)
                            if "interleave" in target:
                                count, widths = grouping(model.family, model, f"{section}.{kind} {canonical!r}")
                                source = table[key] if kind == "modules" else table[key][0]
                                parts[key] = Rule("deinterleave", (source,), fused.index(key), groups=count,
                                                  widths=widths)
        out[kind] = table
    out["parts"], out["rope_rows"], out["one_plus"] = parts, rope_rows, one_plus
    return out


def rope_permutation(model, rows: str) -> torch.Tensor:
    """names.toml ``rope_rows`` (GLM-5): Megatron's row r of the weight is HF's row ``perm[r]``, so that MLA's
    de-interleave of the rope dims (x[0::2], x[1::2]) gives HF's split halves back. `rows`: "head" (every head of
    q_b_proj ends with its rope dims) or "latent" (kv_a_proj_with_mqa ends with them). HF's order back:
    ``argsort(perm)``."""
    attention = model.record.architecture(model).attention
    rope = attention.rotary_dim
    block = {"head": attention.head_dim, "latent": attention.kv_lora_rank + rope}[rows]
    blocks = {"head": attention.heads, "latent": 1}[rows]
    within = list(range(block - rope)) + [block - rope + i // 2 + (i % 2) * (rope // 2) for i in range(rope)]
    return torch.tensor([b * block + r for b in range(blocks) for r in within])


def to_canonical(names: dict, canonical: str, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """`tensor` (a gradient, dim 0, or a module output, dim -1) in HF's order where its rows were permuted on
    loading (``rope_rows``); as it is elsewhere."""
    perm = names.get("rope_rows", {}).get(canonical)
    return tensor if perm is None else tensor.index_select(dim, torch.argsort(perm).to(tensor.device))


def _megatron_rows(names: dict, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as Megatron holds it: its rows permuted where the name map says so (``rope_rows``: GLM-5's
    rope dims; Qwen3.5's gated q_proj), a zero-centred norm gamma w as 1 + w (``one_plus``: Megatron's local norm
    scales by its weight; computed in float32 as HF's Qwen3_5MoeRMSNorm computes 1 + w, float64 in a float64 run)."""
    perm = names.get("rope_rows", {}).get(name)
    if perm is not None:
        tensor = tensor.index_select(0, perm.to(tensor.device))
    if name in names.get("one_plus", ()):
        wide = torch.promote_types(tensor.dtype, torch.float32)
        tensor = (1.0 + tensor.to(wide)).to(tensor.dtype)
    return tensor


def load_weights(model, names: dict, tensors: dict) -> None:
    from harness.capture.torch import apply_rule

    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    expected = {m for m, _ in (names["parameters"] | names.get("detached", {})).values()}
    missing = sorted(set(params) - expected)
    if missing:
        raise RuntimeError(f"Megatron parameters without a name-map entry: {missing[:8]} ...")
    with torch.no_grad():
        for kind, table, store in (("parameter", names["parameters"] | names.get("detached", {}), params),
                                   ("buffer", names["buffers"], buffers)):
            for canonical, (megatron, sources) in table.items():
                if megatron not in store:
                    raise RuntimeError(f"name map: {kind} {megatron!r} (for {canonical!r}) not in the Megatron model")
                part = names.get("parts", {}).get(canonical)
                values = [_megatron_rows(names, s, tensors[s]) for s in sources]
                if part is not None:  # one of the tensors interleaved into `megatron` (each part loads it whole)
                    value = apply_rule(replace(part, kind="interleave"), values)
                else:
                    value = torch.cat(values, dim=0)
                target = store[megatron]
                if tuple(target.shape) != tuple(value.shape):
                    raise RuntimeError(f"{canonical}: checkpoint {tuple(value.shape)} vs Megatron {megatron} "
                                       f"{tuple(target.shape)}")
                if kind == "parameter" and value.dtype != target.dtype:
                    raise RuntimeError(f"{canonical}: checkpoint dtype {value.dtype}, case dtype {target.dtype}")
                if kind == "buffer":  # the expert bias: float32 in the checkpoint and in Megatron's router
                    target.data = value.clone()
                else:
                    target.copy_(value)


# ---------------------------------------------------------------------------------------------- capture

class Capture:
    """Forward hooks on Megatron modules, outputs kept under canonical module names ([s, b, ...] -> [s, ...]).
    Kept small and in one place so it can move onto ``harness/capture/torch.py`` once that exists."""

    def __init__(self, model, modules: dict[str, str], parts: dict | None = None, names: dict | None = None):
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = []
        self.names = names or {}  # the name map: its rope_rows (GLM-5's rope dims, loaded permuted)
        self.parts = parts or {}  # canonical -> the rule taking its part of the module's output (q of linear_qkv)
        named = dict(model.named_modules())
        for canonical, target in modules.items():
            if canonical.endswith(".indexer.selected"):  # DSAttention never calls its indexer: dsa.record_topk
                continue
            pre = target.startswith("pre:")
            module = named[target.removeprefix("pre:")]
            if pre:
                self.handles.append(module.register_forward_pre_hook(self._pre(canonical)))
            else:
                self.handles.append(module.register_forward_hook(self._post(canonical)))

    def _pre(self, canonical):
        def hook(module, args):
            self._keep(canonical, args[0])
        return hook

    def _post(self, canonical):
        def hook(module, args, output):
            if canonical.endswith(".mlp.gate"):  # TopKRouter: (probs [T, E], routing_map [T, E])
                probs, routing_map = output
                indices = torch.nonzero(routing_map)[:, 1].view(routing_map.shape[0], -1)
                # float32 at least, as the contract writes probs: a router in the model dtype (moe_router_dtype
                # None, MiniMax-M2's Bridge setting) gives bf16 scores in bf16; widening them is exact
                wide = torch.promote_types(probs.dtype, torch.float32)
                self.outputs[f"module.{canonical}.probs"] = probs.detach().to(wide, copy=True)
                self.outputs[f"module.{canonical}.topk_indices"] = torch.sort(indices, dim=-1).values
                return
            self._keep(canonical, output[0] if isinstance(output, tuple) else output)
        return hook

    def _keep(self, canonical, tensor):
        # A copy: Megatron reuses some outputs in place afterwards (vocab_parallel_cross_entropy exponentiates fp32
        # logits in place; bias-dropout-add may add into its input).
        tensor = tensor.detach().clone()
        if tensor.dim() >= 3:
            tensor = tensor.squeeze(1)  # [s, b=1, ...]
        if canonical in self.parts:
            from harness.capture.torch import apply_rule

            tensor = apply_rule(self.parts[canonical], [tensor], dim=-1)
        self.outputs[f"module.{canonical}"] = to_canonical(self.names, canonical, tensor, -1)

    def remove(self):
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------- run

# MultiLatentAttention.forward calls self.core_attention(query, key, value, attention_mask, packed_seq_params=...,
# attn_mask_type=...): megatron-core 0.16.1 as installed, and NVIDIA/Megatron-LM
# megatron/core/transformer/multi_latent_attention.py @ 003b4ce2615f4e501ecbc39e01e0f76d237a35d9.
CORE_ATTENTION_ARGUMENTS = ("query", "key", "value")
PART_WHY = ("one part of {module}'s output (q, k and v interleaved per query group): side a's q, k and v would have "
            "to be re-interleaved into it, which this runner does not do; the module's own inputs and outputs around "
            "it are re-fed")
ROPE_ROWS_WHY = ("its output's rope dims are in Megatron's interleaved order (the rows were permuted on loading, "
                 "names.toml rope_rows): side a's tensor would have to be permuted into it, which this runner does not "
                 "do; the modules around it are re-fed")
SELECTION_WHY = "the indexer's top-k choice, not a module output: it is recomputed from the re-fed indexer inputs"
ROUTER_WHY = ("Megatron's TopKRouter returns (probs, routing_map), not one hidden-state tensor: it is recomputed "
              "inside the MoE block from side a's input")


def refeed_hooks(model, names: dict, request: dict):
    """harness.capture.torch.Refeed over the canonical modules that are one Megatron module each (hidden states
    [s, b, h]: batch dim 1), the output layer as lm_head; (the Refeed, the units, {canonical: why not re-fed})."""
    import re

    from harness.capture.torch import Refeed

    parts, rope_rows = names.get("parts", {}), names.get("rope_rows", {})
    units = {c: [t] for c, t in names["modules"].items() if not t.startswith("pre:") and not c.endswith(".mlp.gate")
             and c not in parts and c not in rope_rows and not c.endswith(".indexer.selected")}
    units["lm_head"] = ["output_layer"]
    experts = {re.sub(r"\.experts\.\d+$", ".experts.{E}", c): why for c, why in names["not_captured"].items()}
    not_refed = {**experts, **{c: ROUTER_WHY for c in names["modules"] if c.endswith(".mlp.gate")},
                 **{c: PART_WHY.format(module=names["modules"][c]) for c in names["modules"] if c in parts},
                 **{c: ROPE_ROWS_WHY for c in names["modules"] if c in rope_rows},
                 **{c: SELECTION_WHY for c in names["modules"] if c.endswith(".indexer.selected")}}
    # MLASelfAttention calls core_attention(query, key, value, attention_mask, ...): all three are replaced, so a
    # difference made before them (RoPE, the kv up-projection's split) shows in their rows, not in core attention's
    attention = {c: CORE_ATTENTION_ARGUMENTS for c in units if c.endswith(".self_attn.core_attention")}
    return (Refeed(model, units, request["mode"], request.get("from"), batch_dim=1, arguments=attention), units,
            not_refed)


def forward_backward(model, names, tensors, device, phases, loss_path: str = "megatron", refeed: dict | None = None):
    """Forward with labels (Megatron's per-token cross entropy), masked mean, backward. ``loss_path="float64_logits"``
    is for tests only: the loss from the logits in their own dtype (no fp32 island), to prove the gradient mapping."""
    input_ids, labels = (torch_env.sequences(tensors[name].to(device)) for name in ("input_ids", "labels"))
    b, t = input_ids.shape  # b > 1: the case's sequence first in a batch (--versus batch)
    loss_mask = (labels != IGNORE_INDEX)
    safe_labels = torch.where(loss_mask, labels, torch.zeros_like(labels))  # masked out below (loss_mask)
    position_ids = torch.arange(t, device=device).view(1, -1).expand(b, -1)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1).view(1, 1, t, t)
    padding = tensors.get("attention_mask")  # --versus pad: the first sequence right-padded, its pads masked
    if padding is not None:
        causal = causal | (padding.to(device) == 0).view(b, 1, 1, t)
    own = int(padding[0].sum()) if padding is not None else t  # the first sequence's tokens, padding left out
    capture = Capture(model, names["modules"], names.get("parts"), names)
    logits_box = {}
    # A copy: vocab_parallel_cross_entropy subtracts the max and exponentiates fp32 logits in place.
    hook = model.output_layer.register_forward_hook(
        lambda m, a, o: logits_box.__setitem__("logits", o[0].detach().clone()))
    replay = refeed_hooks(model, names, refeed) if refeed else None  # after capture: its hooks see local tensors
    selections = [c for c in names["modules"] if c.endswith(".indexer.selected")]  # in layer order
    topk = dsa.record_topk() if selections else []
    with phases("forward"):
        if loss_path == "megatron":
            per_token = model(input_ids, position_ids, causal, labels=safe_labels)  # [b, s] fp32
        else:
            logits = model(input_ids, position_ids, causal)[0]  # [s, V]
            per_token = torch.nn.functional.cross_entropy(logits, safe_labels[0], reduction="none").view(1, -1)
        mask = loss_mask.to(per_token.dtype)
        loss = (per_token * mask).sum() / mask.sum()
        torch_env.synchronize(device)
    with phases("backward"):
        loss.backward()
        torch_env.synchronize(device)
    capture.remove()
    hook.remove()
    if len(topk) != len(selections):
        raise RuntimeError(f"DSA top-k computed {len(topk)} times for {len(selections)} indexers")
    capture.outputs.update({f"module.{c}": dsa.selected(i) for c, i in zip(selections, topk, strict=True)})
    if replay:
        hooks, units, not_refed = replay
        refeed.update(tensors=hooks.finish(), meta={**hooks.meta(), "units": list(units),
                                                    "not_refed": {**not_refed, **hooks.not_refed}})
    outputs = {"loss": loss.detach(), **capture.outputs,
               "logits": first_sequence(logits_box["logits"].detach().squeeze(1), b, t, True)[:own]}
    first_sequence_only(outputs, b, t, sequence_first=True, keep=own)  # Megatron captures no routed expert's output
    params = dict(model.named_parameters())
    parts = names.get("parts", {})
    for canonical, (megatron, _) in names["parameters"].items():
        grad = params[megatron].grad
        if grad is None:
            raise RuntimeError(f"no gradient for {megatron} ({canonical})")
        if canonical in parts:  # q, k or v: its rows of linear_qkv's gradient
            from harness.capture.torch import apply_rule

            grad = apply_rule(parts[canonical], [grad]).contiguous()
        outputs[f"grad.{canonical}"] = to_canonical(names, canonical, grad, 0)
    return outputs


def compute(request: dict, phases: Phases, loss_path: str = "megatron", skip_adapters=()):
    """Set up (process group already initialised), run, and return (outputs, meta additions, device)."""
    model_cfg = model_config(request["config"]["model"])  # resolved once, passed typed
    dtype = DTYPES[request["dtype"]]
    with phases("setup"):
        device = torch_env.select_device(request["device"], int(os.environ.get("LOCAL_RANK", 0)))
        determinism = torch_env.apply_determinism(device)
        adapters = install_adapters(device, model_cfg, skip_adapters)
        config, knobs = translate_config(model_cfg, dtype, device)
        model = build_model(config, model_cfg, device, skip_adapters)
        names = name_map(model_cfg)
        tensors = torch_env.load_inputs(request["checkpoint"], device)
        load_weights(model, names, tensors)
        model.train()
    refeed = dict(request["config"]["refeed"]) if request["config"].get("refeed") else None
    outputs = forward_backward(model, names, tensors, device, phases, loss_path, refeed)
    # Megatron's cross entropy is float32 whatever the model dtype; a float64 case gets it exactly upcast.
    outputs["loss"] = outputs["loss"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    meta = {"implementation": families.implementation(model_cfg),
            "adapters": adapters, "knobs": knobs, "not_captured": names["not_captured"],
            "determinism": determinism, "parameter_gradients": len(names["parameters"])}
    if refeed:
        meta["refeed"], meta["_refeed_tensors"] = refeed["meta"], refeed["tensors"]
    return outputs, meta, device


def admit(request: dict) -> None:
    """What both ops need (one step here, N optimizer steps in ``train``): Megatron-Core importable, TP=1 (one
    rank for one step)."""
    if MEGATRON_IMPORT_ERROR is not None:
        raise import_failure("megatron.core", MEGATRON_IMPORT_ERROR) from MEGATRON_IMPORT_ERROR
    if request["op"] not in ("causal_lm", "causal_lm_train"):
        raise Unsupported(f"only ops causal_lm and causal_lm_train run here (got {request['op']!r})")
    if int(request.get("tp", 1)) != 1:
        raise Unsupported("tensor-parallel size 1 only")
    _, world = rank_and_world()
    if request["op"] == "causal_lm" and world != 1:  # a training run checks its train.dp ranks itself
        raise Unsupported("op causal_lm on one rank only")


def run(request: dict, phases: Phases) -> dict:
    admit(request)
    with phases("setup"):
        device = torch_env.select_device(request["device"], int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(device)
    outputs, meta, device = compute(request, phases)
    with phases("write"):
        save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()},
                  os.path.join(request["output_dir"], OUTPUTS))
        if "_refeed_tensors" in meta:
            from harness.capture import REFEED_FILE
            save_file(meta.pop("_refeed_tensors"), os.path.join(request["output_dir"], REFEED_FILE))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    from harness.runners.megatron.runner import te_version

    versions = {"megatron-core": megatron_version, **te_version(),
                **gdn.versions(model_config(request["config"]["model"]))}
    return {"framework": "megatron-core", "versions": versions, **meta,
            "tensor_parallel": 1, "distributed_backend": "nccl" if device.type == "cuda" else "gloo",
            **torch_env.provenance(device)}


def init_process_group(device: torch.device, gloo_groups: bool = False) -> None:
    """Gloo on the CPU, NCCL on a GPU, world size 1 (the existing Megatron runner's setup)."""
    from harness.runners.megatron.runner import init_process_group

    if not dist.is_initialized():
        init_process_group(device, gloo_groups)
