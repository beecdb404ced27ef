"""The hf room: every model family in HF transformers (torch), built by one builder from the family's data: its
architecture (``Family.architecture``) and what transformers calls it (``harness/families/<family>/hf.toml``: the
modeling module and class prefix, the config keys given as they are, the knobs written to meta.json, the quirks'
switches). ``harness.runners.torch.hf_model`` builds, loads and runs what this gives.

Each block once: the transformers config (every key given, none left to transformers' defaults; RoPE settings as
``rope_parameters``, YaRN from the config's ``rope_scaling``, a partial factor where ``hf.toml`` gives one), the model
on the meta device, the RoPE module, the routing record, the float64 mode. The family's quirks are switches, named
where they are read: ``[float64]`` (a text of its own: MiniMax-M2's all-heads q/k norm), ``partial_rotary_factor``
(GLM-4.5's key, MiniMax-M2's rotary_dim that transformers 5.3.0 ignores), ``config_class`` and ``rotary`` (classes
the prefix does not name: Qwen3.5-MoE's text model).

Two transformers releases run here (5.3.0, the harness's own; 5.23.0, the environment a family's hf.toml may name:
``harness.environments``). Where they differ, the room reads what the installed modeling module offers, not its
version: where the routing is returned (``routing``) and whether the RoPE module takes a device (``rotary``).

Float64 (the truth and the semantic check): HF computes RMSNorm, the router (its GEMM, softmax or sigmoid), the RoPE
tables, the attention softmax and the loss in float32 whatever the model's dtype. In a float64 request the runner
replaces exactly those with the same formulas in float64 (``harness.runners.torch.hf_float64``, listed in meta.json
under ``float64_mode``); nothing changes for bfloat16 and float32, and HF's own code is back when the cell ends.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from harness.families import FamilyConfig
from harness.families.expressions import evaluate
from harness.run.protocol import Unsupported
from harness.runners.torch import hf_float64

# Given to every family's transformers config: no dropout, no cache, no pad token, eager attention and experts
COMMON = {"attention_dropout": 0.0, "use_cache": False, "pad_token_id": None, "attn_implementation": "eager",
          "experts_implementation": "eager"}
# The router's float64 forward: by where the routing is read (``routing``), the router's scoring and the module holding
# its routing bias (the architecture's ``expert_bias``: the router, a grouped router; the MoE block; none)
ROUTERS = {("route_tokens_to_experts", "sigmoid", "mlp.gate"): (hf_float64.router_gemm,
                                                                "router GEMM in float64 (HF: float32)"),
           ("router_output", "sigmoid", "mlp.gate"): (hf_float64.grouped_sigmoid_router,
                                                      "router GEMM and sigmoid in float64 (HF: float32)"),
           ("router_output", "softmax", ""): (hf_float64.softmax_router,
                                              "softmax over the experts in float64 (HF: float32)"),
           ("router_output", "sigmoid", "mlp"): (hf_float64.sigmoid_router,
                                                 "sigmoid of the router logits in float64 (HF: float32)")}
LOSS = "fixed_cross_entropy on the float64 logits (HF's ForCausalLMLoss upcasts to float32 first)"


def spec(m: FamilyConfig) -> dict:
    """The family's ``hf.toml``; an error names the file, the field and the value where a switch is not known."""
    data = m.record.stack("hf")
    path = m.record.folder / "hf.toml"
    for key in ("module", "prefix", "router", "keys"):
        if key not in data:
            raise ValueError(f"{path}: no {key!r} (the hf room needs it)")
    return data


def routing(hf) -> str:
    """Where the installed transformers returns the routing, read from the family's modeling module:
    "route_tokens_to_experts" where a MoE block of the module has that method (5.3.0's grouped sigmoid routers:
    DeepSeek-V3, GLM-4.5, GLM-5; the block's method returns (indices, scaled weights), the router only the logits),
    else "router_output" (the router returns (logits, weights, indices): Qwen2/3-MoE and MiniMax-M2, and every
    router in 5.23.0)."""
    own = [c for c in vars(hf).values() if isinstance(c, type) and c.__module__ == hf.__name__]
    return "route_tokens_to_experts" if any("route_tokens_to_experts" in vars(c) for c in own) else "router_output"


def model_class(m: FamilyConfig) -> str:
    """transformers' class of the family's causal LM (meta.json's implementation names it)."""
    return f"{spec(m)['prefix']}ForCausalLM"


def knobs(m: FamilyConfig) -> dict[str, tuple]:
    """The family's knobs {name: (value, why)}, each written to meta.json beside hf_model's own."""
    return {name: (knob["value"], knob["why"]) for name, knob in spec(m).get("knobs", {}).items()}


def modeling(m: FamilyConfig):
    """transformers' modeling module of the family (imported when a run asks for it); UNSUPPORTED where the installed
    transformers has no such model (DeepSeek-V3.2 in 5.3.0: the family's hf.toml names the environment that has it)."""
    module = spec(m)["module"]
    name = f"transformers.models.{module}.modeling_{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in (name, f"transformers.models.{module}"):
            raise
        import transformers

        environment = m.record.stack("hf").get("environment")
        raise Unsupported(f"transformers {transformers.__version__} ({sys.executable}) has no {name}" + (
            f"; the family's hf.toml names the environment {environment!r} for it" if environment else "")) from None


def build(hf, m: FamilyConfig):
    """(the family's causal LM on the meta device, its transformers config): the runner loads every tensor."""
    config = hf_config(m, hf)
    with torch.device("meta"):
        return getattr(hf, model_class(m))(config), config


def hf_config(m: FamilyConfig, hf):
    """transformers' config of the family from the case's typed config: hf.toml's keys as they are (a tuple as a
    list), its ``[config]`` constants, the common ones, and ``rope_parameters``; a key transformers did not keep as
    given (hf.toml's ``kept``, and the partial factor) is refused."""
    s = spec(m)
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(m, k)) for k in s["keys"])}
    rope = rope_parameters(m)
    config_class = s.get("config_class", f"{s['prefix']}Config")
    config = getattr(hf, config_class)(**given, **s.get("config", {}), rope_parameters=rope, **COMMON)
    got = {k: getattr(config, k) for k in s.get("kept", ())}
    if "partial_rotary_factor" in rope:
        got["partial_rotary_factor"] = config.rope_parameters.get("partial_rotary_factor")
    wanted = {k: rope["partial_rotary_factor"] if k == "partial_rotary_factor" else getattr(m, k) for k in got}
    if got != wanted:  # transformers 5.3.0 keeps every one as given; a later one that drops one: refuse
        raise RuntimeError(f"transformers' {type(config).__name__} did not keep {wanted} (got {got})")
    return config


def rope_parameters(m: FamilyConfig) -> dict:
    """transformers 5's RoPE settings: YaRN where the config has a ``rope_scaling`` (DeepSeek-V3), else "default";
    rope_theta from the case, and the partial factor where hf.toml gives one (an expression over the config's
    keys)."""
    scaling = getattr(m, "rope_scaling", None)
    if scaling is not None:
        table = {k: getattr(scaling, k) for k in scaling.__dataclass_fields__ if k != "type"}
        return {"rope_type": scaling.type, "rope_theta": m.rope_theta, **table}
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    factor = spec(m).get("partial_rotary_factor")
    if factor is not None:
        rope["partial_rotary_factor"] = evaluate(factor.removeprefix("="), m.to_dict())
    return rope


def rotary(model, hf, m: FamilyConfig, config, device, dtype: torch.dtype) -> None:
    """Every RoPE module made on `device` (its tables are buffers the checkpoint does not hold): the model's, and
    DeepSeek-V4's compressors' and indexers' own; in float64 the model's tables in float64, unless hf.toml's
    ``[float64_kept]`` keeps HF's ``rope``."""
    make = getattr(hf, rotary_class(m))
    inner = model.model
    for owner in [inner, *(module for module in inner.modules() if module is not inner
                           and isinstance(getattr(module, "rotary_emb", None), make))]:
        if "device" in inspect.signature(make).parameters:  # transformers 5.3.0 computes the tables on `device`
            owner.rotary_emb = make(config=config, device=device)
        else:  # 5.23.0 computes them on the default device: the same place
            with torch.device(device):
                owner.rotary_emb = make(config=config)
    if dtype == torch.float64 and "rope" not in spec(m).get("float64_kept", {}):
        float64_rope = hf_float64.yarn_rope if config.rope_parameters["rope_type"] == "yarn" else \
            hf_float64.default_rope
        float64_rope(model.model.rotary_emb, config)


def rotary_class(m: FamilyConfig) -> str:
    """transformers' RoPE module of the family: ``<prefix>RotaryEmbedding`` unless hf.toml's ``rotary`` names
    another (Qwen3.5-MoE's text model: Qwen3_5MoeTextRotaryEmbedding)."""
    return spec(m).get("rotary", f"{spec(m)['prefix']}RotaryEmbedding")


def record_routing(model, hf, m: FamilyConfig) -> dict:
    """{MoE layer: (top-k indices, routing weights)} as transformers returns them, filled in by the forward,
    unchanged: from the MoE block's method or, a forward hook, from the router's output (``routing``)."""
    gates = {}
    by_method = routing(hf) == "route_tokens_to_experts"
    for layer in m.record.moe_layers(m):
        moe = model.model.layers[layer].mlp
        if by_method:
            _record_route_tokens(moe, layer, gates)
        else:
            moe.gate.register_forward_hook(_router_recorder(layer, gates))
    return gates


def _record_route_tokens(moe, layer: int, gates: dict) -> None:
    original = moe.route_tokens_to_experts

    def routed(router_logits):
        indices, weights = original(router_logits)
        gates[layer] = (indices.detach().clone(), weights.detach().clone())
        return indices, weights

    moe.route_tokens_to_experts = routed


def _router_recorder(layer: int, gates: dict):
    def hook(_module, _args, output):
        _, weights, indices = output
        gates[layer] = (indices.detach().clone(), weights.detach().clone())
    return hook


def record_selection(model, m: FamilyConfig) -> dict:
    """{canonical name: which keys each query attends, [T, keys] int64} for a family with an indexer ({} without
    one), filled in by the forward from the indexer's output (its top-k key indices [1, T, k]) by a forward hook,
    unchanged: 1 where key j is among query i's top-k and attended. A DSA indexer (every earlier token a key): j <=
    i; the causal cut matters: where k exceeds the keys a query may see, the masked keys tie at -inf and top-k picks
    an arbitrary few of them, which attend nothing. DeepSeek-V4's CSA indexer (the T // rate compressed entries its
    compressor makes): it marks picks past the causal edge -1 itself, and those attend nothing."""
    attention = m.record.architecture(m).attention
    if attention.indexer is None:
        return {}
    selected = {}
    if attention.kind == "compressed":
        rate = attention.compression.csa_rate
        for layer in attention.compression.csa_layers:
            indexer = model.model.layers[layer].self_attn.compressor.indexer
            indexer.register_forward_hook(_selection_recorder(
                f"model.layers.{layer}.self_attn.compressor.indexer.selected", selected, rate, causal=False))
        return selected
    for layer, block in enumerate(model.model.layers):
        block.self_attn.indexer.register_forward_hook(_selection_recorder(
            f"model.layers.{layer}.self_attn.indexer.selected", selected, 1, causal=True))
    return selected


def _selection_recorder(name: str, selected: dict, rate: int, causal: bool):
    def hook(_module, _args, indices):
        tokens = indices.shape[1]
        keys = tokens // rate
        picks = indices[0].to(torch.int64)
        chosen = torch.zeros(tokens, keys + 1, dtype=torch.int64, device=indices.device)
        chosen.scatter_(1, torch.where(picks < 0, keys, picks), 1)  # a -1 pick into the last column, dropped
        chosen = chosen[:, :keys]
        selected[name] = torch.tril(chosen) if causal else chosen
    return hook


@contextmanager
def float64_mode(hf, m: FamilyConfig, on: bool = True) -> Iterator[dict]:
    """Inside: HF's RMSNorm, router and eager attention in float64 (when `on`); yields {what: how} for meta.json
    ({} when off; the RoPE tables: ``rotary``; the loss: the runner). hf.toml's ``[float64]`` may give a text of its
    own (``rms_norm``); its ``[float64_kept]`` names the islands (router, attention, rope) left as HF wrote them, each
    with why (DeepSeek-V4 computes them in the model's dtype, or differently), listed in meta.json too."""
    s, arch = spec(m), m.record.architecture(m)
    moe, prefix, texts, kept = arch.moe, s["prefix"], s.get("float64", {}), s.get("float64_kept", {})
    rms_why = texts.get("rms_norm", "normalises in float64 (HF: float32)")
    rms = hf_float64.zero_centred_rms_norm if arch.zero_centred_norms else hf_float64.rms_norm
    islands = [(getattr(hf, f"{prefix}RMSNorm"), "forward", rms, f"{prefix}RMSNorm.forward", rms_why)]
    if moe is not None and "router" not in kept:  # a dense family has no router
        router, router_why = ROUTERS[(routing(hf), moe.scoring, moe.expert_bias)]
        islands.append((getattr(hf, s["router"]), "forward", router, f"{s['router']}.forward", router_why))
    if "attention" not in kept:
        islands.append((hf, "eager_attention_forward", hf_float64.eager_attention(hf), "eager_attention_forward",
                        "softmax in float64 (HF: float32)"))
    with hf_float64.islands(islands, on) as replaced:
        if on:
            yarn = rope_parameters(m)["rope_type"] == "yarn"
            if "rope" not in kept:
                replaced = {**replaced, rotary_class(m): f"{'YaRN inverse' if yarn else 'inverse'} "
                            "frequencies and cos/sin tables in float64 (HF: float32)"}
            replaced = {**replaced, "loss": LOSS, **{f"{island} (HF's own)": why for island, why in kept.items()}}
        yield replaced
