"""Paddle whole-model runner (op ``causal_lm``, docs/model-contract.md): DeepSeek-V3 / Kimi-K2 forward, LM loss and
backward, with module outputs and every parameter gradient in canonical names.

Which implementation runs (written to ``meta.json`` ``implementation``):
- GPU: PaddleFleet's ``GPTModel`` (multi-latent attention, MoE) with ``use_accuracy_compatible`` from the case config.
  It needs paddlefleet (and a CUDA build of paddle); where paddlefleet does not import the request is UNSUPPORTED
  (exit 3) and says so, because a GPU verdict is meant to be about PaddleFleet's model. Written from PaddleFleet's
  public source, read file by file (it could not be run here):
    PaddlePaddle/PaddleFleet src/paddlefleet/models/gpt/gpt_layer_specs.py @ aadcacc6930f8fce858b3577aec6cc5acf46ffb4
      (get_gpt_decoder_layers_spec, get_gpt_mtp_layers_spec, get_gpt_spec(..., position_embedding_type="yarn"))
    PaddlePaddle/PaddleFleet src/paddlefleet/models/gpt/gpt_model.py @ 509f514620fe6bf7cec36afdc94472cb7a3add7b
      (GPTModel, a PipelineLayer of embedding, transformer layers, final norm, lm_head)
  The GPU path below stops at UNSUPPORTED before building anything unless paddlefleet imports; see ``_fleet_model``.
- CPU: PaddleFormers' ``paddleformers.transformers.deepseek_v3.DeepseekV3ForCausalLM`` (Paddle dygraph) on its
  non-fused paths; every knob set is in ``meta.json`` ``knobs`` with why (``KNOBS``). PaddleFormers imports the
  GPU-only ``paddlefleet_ops`` at import time: a stand-in that only answers "DeepEP not available" is installed when
  the real package is missing (``harness.runners.paddle.paddlefleet_ops_shim``; ``meta.json`` ``adapters``).
  bf16: Paddle's dygraph has no CPU bf16 matmul kernel, so the request is UNSUPPORTED naming it.

Weights: the case's HF-named safetensors through ``harness/case/models/deepseek_v3.toml`` ``[paddle]`` (Paddle's
linears are ``[in, out]``: transposed). Loss: PaddleFormers' own criterion (``CriterionLayer``, ``sft`` loss): CE of
``logits[t]`` against ``labels[t]`` with no shift (the contract's labels are already shifted), in float32, summed over
``labels != -100`` and divided by their count. Captures: ``harness.capture.paddle``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from harness.run.protocol import OUTPUTS, Phases, Unsupported, import_failure

try:
    import paddle
except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR (in run)
    paddle = None
    PADDLE_IMPORT_ERROR = error

NAME_MAP = Path(__file__).resolve().parents[2] / "case" / "models" / "deepseek_v3.toml"
DTYPES = ("float32", "float64", "bfloat16")

# PaddleFormers config knobs this runner sets, and why. Everything else comes from the case's HF config keys.
KNOBS = {
    "fuse_rms_norm": (False, "default True calls paddle.incubate fused_rms_norm_ext (a GPU kernel); False takes "
                             "RMSNorm's plain Paddle ops (variance in float32, rsqrt, multiply)"),
    "fuse_swiglu": (False, "the unfused MLP path (silu(gate) * up, gate and up separate linears), as HF computes it"),
    "apply_rope_fusion": (False, "the unfused rotary embedding (rotate_half), no fused_rotary_position_embedding"),
    "_attn_implementation": ("eager", "eager attention (matmul, additive causal mask, float32 softmax, matmul), the "
                                      "path HF's eager attention also takes; sdpa/flashmask are other kernels"),
    "use_fused_linear_cross_entropy": (False, "logits are materialised (the contract captures them); the fused "
                                              "linear+CE is a Triton kernel"),
    "use_fused_head_and_loss_fn": (False, "the same: lm_head then CrossEntropyLoss, not fused"),
    "use_filtered_label_loss": (False, "CE over all positions, masked by labels != -100 (the contract's mean)"),
    "loss_subbatch_sequence_length": (-1, "no sub-batched loss"),
    "moe_subbatch_token_num_before_dispatch": (0, "no sub-batched MoE recompute"),
    "recompute_granularity": (None, "no recomputation: one forward, hooks see each module once"),
    "num_nextn_predict_layers": (0, "no multi-token-prediction layers (the contract has none)"),
    "fd_fallback": (False, "routed experts as a LayerList of per-expert MLPs (capturable per expert), not the fused "
                           "3-D DeepseekV3NaiveMoe"),
    "tensor_model_parallel_size": (1, "TP=1: plain paddle.nn.Linear everywhere"),
    "sequence_parallel": (False, "TP=1"),
    "use_cache": (False, "training forward, no KV cache"),
    "attention_dropout": (0.0, "deterministic"),
}


def admit(request: dict) -> dict:
    """What both ops need (one step here, N optimizer steps in ``train``): paddle importable, TP=1, a dtype it runs,
    on the CPU a bf16 matmul kernel where the case is bf16; returns the provenance both write."""
    if paddle is None:
        raise import_failure("paddle", PADDLE_IMPORT_ERROR) from PADDLE_IMPORT_ERROR
    if request["op"] not in ("causal_lm", "causal_lm_train"):
        raise Unsupported(f"paddle_model runs ops causal_lm and causal_lm_train only (got {request['op']!r})")
    if request.get("tp", 1) != 1:
        raise Unsupported(f"paddle_model runs TP=1 only (got tp={request['tp']})")
    if request["dtype"] not in DTYPES:
        raise Unsupported(f"paddle_model: dtype {request['dtype']} is not one of {', '.join(DTYPES)}")
    provenance = {"framework": "paddle", "versions": {"paddlepaddle": paddle.__version__,
                                                      "paddle_commit": paddle.version.commit},
                  "use_accuracy_compatible": request["config"].get("use_accuracy_compatible", True)}
    if request["device"] == "cpu":
        paddle.set_device("cpu")
        if request["dtype"] == "bfloat16":
            _probe_cpu_bf16_matmul()
    return provenance


def run(request: dict, phases: Phases) -> dict:
    provenance = admit(request)
    if request["device"] == "gpu":
        return {**provenance, **_fleet_model(request, phases)}
    return {**provenance, **_paddleformers_model(request, phases)}


# ---------------------------------------------------------------------------------------------------------------
# CPU: PaddleFormers

def _paddleformers_model(request: dict, phases: Phases) -> dict:
    from harness.runners.paddle import paddlefleet_ops_shim

    with phases("import"):
        adapter = paddlefleet_ops_shim.install()
        import paddleformers
        from paddleformers.transformers.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

        from harness.capture.paddle import capture, write
    dtype = request["dtype"]
    m = dict(request["config"]["model"])
    if not m.pop("rope_interleave", True):
        raise Unsupported("rope_interleave = False: PaddleFormers' DeepseekV3 always de-interleaves the rope dims "
                          "(apply_rotary_pos_emb reshapes [d/2, 2] -> [2, d/2]); it has no non-interleaved path")
    m.pop("family", None)
    with phases("setup"):
        model, checkpoint, name_map, loaded = build_model(m, dtype, request["checkpoint"], DeepseekV3Config,
                                                         DeepseekV3ForCausalLM)
        input_ids = paddle.to_tensor(checkpoint["input_ids"].reshape(1, -1))
        labels = paddle.to_tensor(checkpoint["labels"].reshape(1, -1))
        routers = {layer: _record_router(model.model.layers[layer].mlp.gate)
                   for layer in range(m["num_hidden_layers"]) if hasattr(model.model.layers[layer].mlp, "gate")}
    modules, grads = canonical_modules(m), canonical_grads(m)
    hooked = [name for name in modules if not name.endswith((".gate.topk_indices", ".gate.probs"))]  # recorded
    refeed_request = request["config"].get("refeed")
    with capture(model, None, name_map=name_map, modules=hooked, grads=grads) as cap:
        refeed = None
        if refeed_request:  # after capture: its hooks see the local tensors
            from harness.capture import EXPERT_WHY, refeed_units
            from harness.capture.paddle import Refeed

            units, not_refed = refeed_units(hooked, lambda n: name_map.rule("modules", n),
                                            extra={"lm_head": ["lm_head"]}, skip={r"\.experts\.\d+$": EXPERT_WHY})
            refeed = Refeed(model, units, refeed_request["mode"], refeed_request.get("from"), batch_dim=0)
        with phases("forward"):
            out = _kernel_guard(lambda: model(input_ids=input_ids, labels=labels, return_dict=True),
                                "DeepseekV3ForCausalLM forward", request)
        with phases("backward"):
            _kernel_guard(lambda: out.loss.backward(), "DeepseekV3ForCausalLM backward", request)
        cap.record("logits", out.logits[0])
        cap.record("loss", out.loss.reshape([]))  # a scalar, as the contract writes it
        refeed_tensors = refeed.finish() if refeed else {}
    with phases("write"):
        tensors, routed = _routing(cap.tensors, routers, m["n_routed_experts"] if routers else 0)
        upcast = {}
        tensors = {name: _to_case_dtype(name, array, dtype, upcast) for name, array in tensors.items()}
        order = ["module." + x for x in modules] + ["logits", "loss"] + ["grad." + g for g in grads]
        Path(request["output_dir"]).mkdir(parents=True, exist_ok=True)
        write(tensors, os.path.join(request["output_dir"], OUTPUTS), order)
        if refeed:
            from harness.capture import REFEED_FILE
            write(refeed_tensors, os.path.join(request["output_dir"], REFEED_FILE))
    refeed_meta = {"refeed": {**refeed.meta(), "units": list(units),
                              "not_refed": {**_fold_experts(not_refed), **refeed.not_refed}}} if refeed else {}
    return {**refeed_meta,
        "implementation": "paddleformers.transformers.deepseek_v3.DeepseekV3ForCausalLM (Paddle dygraph, CPU, "
                          "non-fused paths; PaddleFormers' own CriterionLayer sft loss)",
        "versions": {"paddlepaddle": paddle.__version__, "paddle_commit": paddle.version.commit,
                     "paddleformers": getattr(paddleformers, "__version__", "unknown")},
        "adapters": [adapter] if adapter else [],
        "paddlefleet_ops": "stand-in (harness)" if adapter else "real package",
        "knobs": {knob: {"value": value, "why": why} for knob, (value, why) in KNOBS.items()},
        "name_map": f"{name_map.__class__.__module__}.{name_map.__class__.__name__} [paddle] of {NAME_MAP.name}",
        "weights_loaded": loaded,
        "not_captured": cap.not_captured,
        "zero_grads": cap.zero_grads,
        "routing": routed,
        "upcast_exactly": upcast,
        "use_accuracy_compatible_note": "read by PaddleFleet only; PaddleFormers has no such switch",
    }


def build_model(m: dict, dtype: str, checkpoint_path: str, config_class, model_class):
    """PaddleFormers' DeepseekV3ForCausalLM with KNOBS, every weight from the checkpoint, in train mode; (model,
    checkpoint arrays, name map, number of tensors loaded). Also the training runner's (harness.runners.paddle.train).
    `m`: the case's model config without `family` and `rope_interleave`."""
    from safetensors.paddle import load_file

    checkpoint = {name: tensor.numpy() for name, tensor in load_file(checkpoint_path).items()}
    config = config_class(**m)
    for knob, (value, _) in KNOBS.items():
        setattr(config, knob, value)
    paddle.set_default_dtype(dtype)
    paddle.seed(0)  # construction draws initial weights; all of them are overwritten from the checkpoint
    model = model_class(config)
    model.train()  # the training path (dropout is 0): what a training step computes
    name_map = load_name_map()
    return model, checkpoint, name_map, _load_weights(model, checkpoint, name_map)


def _fold_experts(names: dict[str, str]) -> dict[str, str]:
    import re
    return {re.sub(r"\.experts\.\d+$", ".experts.{E}", name): why for name, why in names.items()}


def canonical_modules(m: dict) -> list[str]:
    """The contract's module paths in forward order (without "module."; the router's two are recorded apart)."""
    names = ["model.embed_tokens"]
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
            "core_attention", "o_proj"]
    for layer in range(m["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        names += [f"{p}.input_layernorm", *(f"{p}.self_attn.{a}" for a in attn), f"{p}.post_attention_layernorm"]
        if layer < m["first_k_dense_replace"]:
            names += [f"{p}.mlp.gate_up_proj", f"{p}.mlp.act", f"{p}.mlp.down_proj"]
        else:
            names += [f"{p}.mlp.gate.topk_indices", f"{p}.mlp.gate.probs"]
            names += [f"{p}.mlp.experts.{e}" for e in range(m["n_routed_experts"])]
            names += [f"{p}.mlp.shared_experts", f"{p}.mlp"]
        names.append(p)
    return [*names, "model.norm"]


def canonical_grads(m: dict) -> list[str]:
    """The contract's gradient names (without "grad."), gate and up fused: 794 for Kimi-K2's 2-layer shape."""
    names = ["model.embed_tokens.weight"]
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    for layer in range(m["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        names += [f"{p}.input_layernorm.weight", *(f"{p}.self_attn.{a}.weight" for a in attn),
                  f"{p}.post_attention_layernorm.weight"]
        if layer < m["first_k_dense_replace"]:
            names += [f"{p}.mlp.gate_up_proj.weight", f"{p}.mlp.down_proj.weight"]
            continue
        names.append(f"{p}.mlp.gate.weight")
        for e in range(m["n_routed_experts"]):
            names += [f"{p}.mlp.experts.{e}.gate_up_proj.weight", f"{p}.mlp.experts.{e}.down_proj.weight"]
        names += [f"{p}.mlp.shared_experts.gate_up_proj.weight", f"{p}.mlp.shared_experts.down_proj.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


def _record_router(gate) -> dict:
    """The router sublayer's own (indices [T, k], weights [T, k]) output, copied to the host as it leaves forward."""
    seen = {}

    def hook(_layer, _inputs, output):
        seen["indices"], seen["weights"] = (np.array(t.detach().cpu().numpy(), copy=True) for t in output[:2])

    gate.register_forward_post_hook(hook)
    return seen


def _routing(tensors: dict, routers: dict, experts: int) -> tuple[dict, dict]:
    """topk_indices (each row ascending) and probs [T, E] (the weights at their experts, zero elsewhere): a sort and
    a scatter, exact. Expert outputs are kept only for experts the router chose: PaddleFormers also runs every idle
    expert once on one zero row (a dummy for the gradient graph), which is no output of the model."""
    tensors = dict(tensors)
    summary = {}
    for layer, seen in routers.items():
        p = f"module.model.layers.{layer}.mlp"
        indices, weights = seen["indices"], seen["weights"]
        tensors[f"{p}.gate.topk_indices"] = np.sort(indices, axis=-1).astype(np.int64)
        probs = np.zeros((indices.shape[0], experts), dtype=weights.dtype)
        np.put_along_axis(probs, indices, weights, axis=-1)
        tensors[f"{p}.gate.probs"] = probs
        chosen = set(np.unique(indices).tolist())
        for e in range(experts):
            if e not in chosen:
                tensors.pop(f"{p}.experts.{e}", None)
        summary[f"layer {layer}"] = {"experts_with_tokens": len(chosen)}
    return tensors, summary


class _LocalNameMap:
    """Reads one section of the name map when the shared reader (``harness.case.models.NameMap``) is not there:
    the same rule lookup (first pattern that matches, placeholders filled; otherwise "same")."""

    KINDS = ("same", "transpose", "transpose_cat0", "cat0", "cat_last", "slice", "input_of", "output_of",
             "not_captured")

    def __init__(self, tables: dict):
        self.tables = tables

    def rule(self, section: str, name: str):
        import re
        from types import SimpleNamespace

        for pattern, raw in self.tables.get(section, {}).items():
            text = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
            match = re.fullmatch(text.replace(r"\*", ".*"), name)
            if match is None:
                continue
            raw = {"same": raw} if isinstance(raw, str) else raw
            kind = next(k for k in raw if k in self.KINDS)
            if kind == "not_captured":
                return SimpleNamespace(kind=kind, sources=(), index=None, why=raw[kind])
            fill = match.groupdict()

            def filled(template, fill=fill):
                for key, value in fill.items():
                    template = template.replace("{" + key + "}", value)
                return template

            value = raw[kind]
            sources = tuple(filled(v) for v in ([value] if isinstance(value, str) else value))
            index = int(filled(str(raw["index"]))) if "index" in raw else None
            return SimpleNamespace(kind=kind, sources=sources, index=index, why="")
        return SimpleNamespace(kind="same", sources=(name,), index=None, why="")


def load_name_map():
    """[paddle] of harness/case/models/deepseek_v3.toml, through the shared reader where this tree has it."""
    try:
        from harness.case.models import NameMap
    except ImportError:
        import tomllib

        return _LocalNameMap(tomllib.loads(NAME_MAP.read_text())["paddle"])
    return NameMap.load("deepseek_v3", "paddle")


def _load_weights(model, checkpoint: dict, name_map) -> int:
    """Every parameter and the expert-bias buffers from the checkpoint through [paddle.checkpoint]; refuses to run
    with one left out."""
    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name, target in targets.items():
        rule = name_map.rule("checkpoint", name)
        if rule.kind not in ("same", "transpose"):
            raise ValueError(f"[paddle.checkpoint] {name}: rule {rule.kind} is not one this runner applies")
        missing = [s for s in rule.sources if s not in checkpoint]
        if missing:
            raise KeyError(f"model tensor {name!r} needs checkpoint tensor(s) {missing} (rule {rule.kind})")
        value = checkpoint[rule.sources[0]]
        value = np.swapaxes(value, -1, -2) if rule.kind == "transpose" else value
        if list(value.shape) != list(target.shape):
            raise ValueError(f"{rule.sources[0]} {list(value.shape)} ({rule.kind}) does not fit {name} "
                             f"{list(target.shape)}")
        tensor = paddle.to_tensor(np.ascontiguousarray(value), place=paddle.CPUPlace())
        if tensor.dtype != target.dtype:  # the router weight is a float32 parameter in every case dtype
            tensor = tensor.astype(target.dtype)
        target.set_value(tensor)
    return len(targets)


def _to_case_dtype(name: str, array: np.ndarray, dtype: str, upcast: dict) -> np.ndarray:
    """Outputs in the case dtype where Paddle holds a narrower float (float32 loss and router-weight gradient in a
    float64 run): an exact upcast, listed in meta.json. Indices, probabilities (float32 by contract) and anything that
    would need rounding stay as Paddle held them."""
    if dtype != "float64" or array.dtype != np.float32 or name.endswith(".probs"):
        return array
    upcast[name] = "float32 -> float64 (exact)"
    return array.astype(np.float64)


def _probe_cpu_bf16_matmul() -> None:
    """Ask Paddle's dygraph for its CPU bf16 matmul kernel before building anything."""
    a = paddle.ones([2, 2], dtype="float32").astype("bfloat16")
    try:
        paddle.matmul(a, a)
    except Exception as error:  # Paddle raises a bare NotFoundError/RuntimeError from C++; anything else: ERROR
        first = next((line.strip() for line in str(error).splitlines() if "not registered" in line), "")
        if not first:
            raise
        raise Unsupported("matmul (CPU, bfloat16) not registered: Paddle dygraph has no CPU bf16 matmul kernel, "
                          f"which every linear of the model needs ({first})") from None


def _kernel_guard(call, what: str, request):
    """A kernel Paddle lacks here becomes UNSUPPORTED naming it; so does PaddleFormers' MoE in float64 (below);
    anything else is a crash."""
    try:
        return call()
    except Exception as error:
        if "not registered" in str(error):
            first = next(line.strip() for line in str(error).splitlines() if "not registered" in line)
            raise Unsupported(f"{what} on {request['device']} in {request['dtype']}: {first}") from error
        if request["dtype"] == "float64" and _raised_in(error, "deepseek_v3/modeling.py", "moe") \
                and "does not match the type of data" in str(error):
            raise Unsupported(
                "PaddleFormers' DeepseekV3MoE.moe cannot run in float64: it accumulates the routed experts into "
                "zeros_like(hidden_states, dtype=topk_weights.dtype), and the router's weights are float32 by "
                "construction (scores.cast(float32)), so index_add_ of the float64 expert outputs into that float32 "
                f"buffer is refused ({str(error).strip().splitlines()[0]}); a float64 case needs dense layers only "
                "(first_k_dense_replace = num_hidden_layers)") from error
        raise


def _raised_in(error: BaseException, file_suffix: str, function: str) -> bool:
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith(file_suffix) and code.co_name == function:
            return True
        traceback = traceback.tb_next
    return False


# ---------------------------------------------------------------------------------------------------------------
# GPU: PaddleFleet

def _fleet_model(request: dict, phases: Phases) -> dict:
    """PaddleFleet's GPTModel, required on a GPU. Nothing is built unless paddlefleet imports."""
    try:
        import paddlefleet  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR
        failure = import_failure("paddlefleet", error)
        if not isinstance(failure, Unsupported):
            raise failure from error
        raise Unsupported(f"{failure}: on a GPU the Paddle side is PaddleFleet's GPTModel (multi-latent attention, "
                          "MoE, use_accuracy_compatible); install paddlefleet and paddlefleet-ops (Paddle's package "
                          "index) next to paddlepaddle-gpu >= 3.3") from None
    # The construction, as read (files and commits in the module docstring, plus
    # src/paddlefleet/models/gpt/gpt_config.py @ 6ab5862788a71923b445457b759180d29dcf9740 and
    # src/paddlefleet/transformer/transformer_config.py @ d045321053807ddaea2de00dc77e40e5d2039653):
    #   config = GPTConfig(**HF-named fields)  # TransformerConfig takes HF names: hidden_size, num_attention_heads,
    #       # intermediate_size, moe_intermediate_size, n_routed_experts, n_shared_experts, num_experts_per_tok,
    #       # scoring_func, topk_method, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
    #       # rms_norm_eps, rope_theta, rope_scaling (a dict); plus multi_latent_attention=True,
    #       # normalization="RMSNorm", gated_linear_unit=True, hidden_act=F.silu, moe_layer_freq = [0] * dense + [1] *
    #       # moe (a 0/1 list per layer), position_embedding_type="yarn", params_dtype, tensor_model_parallel_size=1,
    #       # parallel_output=False, use_accuracy_compatible (from the case), gpt_model_use_experimental_version
    #   layers = get_gpt_decoder_layers_spec(config, normalization="RMSNorm")
    #   spec = get_gpt_spec(config, layers, mtp_layers_spec=None, vocab_size, max_sequence_length,
    #                       position_embedding_type="yarn", rotary_base=rope_theta, rope_scaling=...,
    #                       parallel_output=False)
    #   model = paddle.distributed.fleet.meta_parallel.build_spec_layer(spec, num_stages=1)
    #   logits = model({"input_ids": ids, "position_ids": positions, "attention_mask": causal})
    # What is missing is a [paddlefleet] section of the name map: GPTModel names its sublayers by position
    # ("model.layers.{i}" through add_sequential_layer), fuses gate and up (up_gate_proj) and may group the experts;
    # those names can only be listed from a built model, which needs a GPU build of paddle and paddlefleet. Until a
    # run on such a machine lists them, a GPU request with paddlefleet present stops here rather than write tensors
    # under names nobody checked.
    raise Unsupported("paddlefleet imports, but the PaddleFleet GPTModel path of paddle_model has not been run "
                      "anywhere yet (written from source only: see harness/runners/paddle/model.py); no verdict")
