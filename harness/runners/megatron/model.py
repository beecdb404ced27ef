"""Megatron-Core model runner (op ``causal_lm``): ``GPTModel`` with the local spec (no Transformer Engine),
``MLASelfAttention`` and ``MoELayer`` with ``SequentialMLP`` experts, for DeepSeek-V3 / Kimi-K2 configs given in
HF ``DeepseekV3Config`` key names (``docs/model-contract.md``).

The HF config is translated to ``MLATransformerConfig`` (``translate_config``); the HF-named checkpoint is loaded
through the ``[megatron]`` section of ``harness/case/models/deepseek_v3.toml``; the forward runs with labels so that
Megatron's own LM-loss path computes the per-token cross entropy, and the loss is its mean over the positions whose
label is not -100 (Megatron's ``loss_mask`` convention). Module outputs come from forward hooks (``capture``),
parameter gradients from ``param.grad``, all written in canonical names with the batch dim dropped.

Adapters (each listed in meta.json, none changes a computation; ``tests/test_megatron_model.py`` tests each):
- ``MLADotProductAttention``: the local ``DotProductAttention`` refuses the ``k_channels``/``v_channels`` that
  ``MLASelfAttention`` passes. The subclass accepts them and sizes its output view with ``v_channels`` (MLA's v head
  dim differs from the qk head dim); the scores and context are the parent's own code, with MLA's softmax scale.
- CPU only: ``torch.cuda.current_device`` returns ``"cpu"`` (YaRN RoPE, router buffers and the global memory buffer
  ask for the "current GPU"); the RNG tracker is initialised without CUDA (``DotProductAttention`` forks it
  around a dropout of p=0); 0.16.1's ``moe_utils.te_general_gemm`` is defined as None without TE.
The causal mask is passed explicitly (``get_default_causal_mask`` hard-codes CUDA): input, not an adapter.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import tomllib

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # jit_fuser is torch.compile: keep eager numerics

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harness.run.cell_state import patch  # noqa: E402
from harness.run.protocol import (  # noqa: E402
    OUTPUTS,
    Phases,
    Unsupported,
    import_failure,
    rank_and_world,
)
from harness.runners.torch import env as torch_env  # noqa: E402

try:
    from megatron.core import __version__ as megatron_version
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR (in run)
    MEGATRON_IMPORT_ERROR: Exception | None = error
    DotProductAttention = object
else:
    MEGATRON_IMPORT_ERROR = None

NAME_MAP = Path(__file__).resolve().parents[2] / "case" / "models" / "deepseek_v3.toml"
DTYPES = {**torch_env.DTYPES, "float64": torch.float64}
IGNORE_INDEX = -100


class MLADotProductAttention(DotProductAttention):
    """The local ``DotProductAttention`` as MLA calls it: ``k_channels`` (qk head dim incl. RoPE) and ``v_channels``
    accepted. Its computation reads the head dims from the query/key/value tensors themselves (``reshape(..., -1)``);
    the only size taken from the config is the output view ``hidden_size_per_partition`` (kv_channels * heads),
    which must be ``v_channels * heads`` here. The softmax scale is MLA's explicit one (YaRN mscale^2 / sqrt(qk))."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.k_channels, self.v_channels = k_channels, v_channels


ADAPTER_DOCS = {
    "MLADotProductAttention": "subclass of megatron.core.transformer.dot_product_attention.DotProductAttention that "
    "accepts MLASelfAttention's k_channels/v_channels keywords (the local class refuses them) and sizes its output "
    "view [s, b, heads * v_head_dim] from v_channels; scores, softmax and context are the parent's code",
    "cpu_current_device": "CPU only: torch.cuda.current_device() returns 'cpu' (YarnRotaryEmbedding, TopKRouter "
    "buffers and the global memory buffer ask for the current GPU)",
    "cpu_rng_tracker": "CPU only: tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True) instead "
    "of model_parallel_cuda_manual_seed (DotProductAttention forks the CUDA RNG tracker around dropout p=0)",
    "mla_have_te_false": "without Transformer Engine: multi_latent_attention.HAVE_TE = False. Megatron's TE extension "
    "module imports with MagicMock stand-ins, so MLA believes TE is present and its isinstance(linear_proj, TELinear) "
    "check (fp8/fp4 only) raises TypeError on the mock; the flag only guards TE/fp8 branches",
    "te_general_gemm_none": "megatron-core < 0.19 without Transformer Engine: moe_utils.te_general_gemm = None "
    "(the router references the name unguarded)",
}


def install_adapters(device: torch.device, skip=()) -> list[dict]:
    """The shims (the CPU ones only on a CPU), each returned as a meta.json entry; `skip` is for the tests that
    show each one is needed. Each patch lasts for this cell only (``harness.run.cell_state.patch``)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    names = [] if "MLADotProductAttention" in skip else ["MLADotProductAttention"]
    if not te_importable() and multi_latent_attention.HAVE_TE and "mla_have_te_false" not in skip:
        patch(multi_latent_attention, "HAVE_TE", False)
        names.append("mla_have_te_false")
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
    return [{"name": n, "why": ADAPTER_DOCS[n], "changes_computation": False} for n in names]


def te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401  (probed only: this runner never uses it)
    except ImportError:
        return False
    return True


def translate_config(model: dict, dtype: torch.dtype, device: torch.device, expert_parallel: int = 1):
    """HF ``DeepseekV3Config`` keys -> (``MLATransformerConfig``, knobs: every setting chosen and why);
    `expert_parallel`: the experts split over that many ranks (a training run's train.ep)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def need(condition, why):
        if not condition:
            raise Unsupported(f"megatron_model: {why}")

    layers, experts, topk = model["num_hidden_layers"], model["n_routed_experts"], model["num_experts_per_tok"]
    need(model.get("scoring_func", "sigmoid") == "sigmoid", "only scoring_func sigmoid is mapped")
    need(model.get("norm_topk_prob", True) or topk == 1,
         "Megatron's sigmoid router always normalises the top-k probabilities (norm_topk_prob false)")
    need(not model.get("tie_word_embeddings", False), "tied embeddings are not mapped")
    need(not model.get("attention_bias", False), "attention_bias is not mapped")
    need(model.get("num_key_value_heads", model["num_attention_heads"]) == model["num_attention_heads"],
         "MLA with num_key_value_heads != num_attention_heads")
    need(model.get("q_lora_rank") is not None, "q_lora_rank None (linear_q_proj) is not mapped")
    n_group, topk_group = model.get("n_group") or 1, model.get("topk_group") or 1
    # HF picks groups by the sum of each group's top-2 scores; Megatron by the sum of its top (topk // group_topk).
    need(n_group == 1 or topk // topk_group == 2,
         f"group-limited routing with topk {topk} / topk_group {topk_group} != 2 (HF sums each group's top-2)")
    rope = dict(model.get("rope_scaling") or {})
    rope_type = rope.get("type", rope.get("rope_type", "default"))
    need(rope_type in ("yarn", "default"), f"rope_scaling type {rope_type!r}")
    need(model.get("rope_interleave", True), "rope_interleave false (Megatron's MLA RoPE de-interleaves)")
    dense = int(model.get("first_k_dense_replace", 0))
    yarn = {}
    if rope_type == "yarn":
        yarn = dict(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                    beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                    mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    else:
        yarn = dict(rope_type="rope", rotary_scaling_factor=1.0)
    router_dtype = "fp64" if dtype == torch.float64 else "fp32"
    knobs = {
        "spec": "get_gpt_decoder_block_spec(use_transformer_engine=False, normalization='RMSNorm'): local modules, "
                "WrappedTorchNorm (torch.nn.RMSNorm) for every norm incl. the final one",
        "moe_layer_freq": f"{dense} dense layer(s) then MoE (first_k_dense_replace)",
        "moe_grouped_gemm": "False: SequentialMLP, one MLP per expert",
        "moe_token_dispatcher_type": "allgather" + (
            f": expert_model_parallel_size {expert_parallel}, every rank all-gathers the tokens and runs its own "
            "experts on those routed to them" if expert_parallel > 1 else " (one expert-parallel rank)"),
        "moe_router_dtype": f"{router_dtype}: the gating GEMM and routing in {router_dtype} (fp32 is Kimi-K2's "
                            "training setting; float64 cases keep float64). Megatron computes sigmoid(logits.float()) "
                            "in fp32 whatever this says",
        "router_gating_gemm": "megatron-core >= 0.19 with Transformer Engine installed: te_general_gemm for a fp32 "
                              "router (Megatron's own choice); otherwise torch (RouterGatingLinearFunction)",
        "moe_router_load_balancing_type": "none, moe_aux_loss_coeff 0: no auxiliary loss in the gradients "
                                          "(HF has none)",
        "moe_router_num_groups": f"{n_group if n_group > 1 else None} (n_group), group_topk "
                                 f"{topk_group if n_group > 1 else None}",
        "bias_activation_fusion": "True: SwiGLU through bias_swiglu_impl / weighted_bias_swiglu_impl (hand-written "
                                  "backward), eager (TORCHDYNAMO_DISABLE=1)",
        "attention_softmax_in_fp32": "True: FusedScaleMaskSoftmax's unfused path upcasts bf16 scores "
                                     "(no-op in fp32/64)",
        "masked_softmax_fusion": "False: the torch softmax path (the fused kernels are CUDA extensions)",
        "apply_rope_fusion": "False: unfused MLA RoPE (_apply_rotary_pos_emb_bshd, de-interleaving HF's rope dims)",
        "cross_entropy_loss_fusion": "False: tensor_parallel.vocab_parallel_cross_entropy (fp32 logits)",
        "hidden_dropout / attention_dropout": "0.0",
        "attention_backend": "local: the local spec's DotProductAttention (with the default 'auto', GPTModel asserts "
                             "on the NVTE_FLASH_ATTN=0 / NVTE_FUSED_ATTN=0 the harness sets on a GPU)",
        "share_embeddings_and_output_weights": "False",
        "deterministic_mode": "False (F.embedding)",
        "params_dtype": f"{dtype}: GPTModel cast with .to(dtype) as Float16Module does for bf16 (norm weights "
                        "included); the router's expert_bias stays float32 (Megatron keeps it so)",
    }
    config = MLATransformerConfig(
        num_layers=layers, hidden_size=model["hidden_size"], ffn_hidden_size=model["intermediate_size"],
        num_attention_heads=model["num_attention_heads"],
        q_lora_rank=model["q_lora_rank"], kv_lora_rank=model["kv_lora_rank"], qk_head_dim=model["qk_nope_head_dim"],
        qk_pos_emb_head_dim=model["qk_rope_head_dim"], v_head_dim=model["v_head_dim"],
        rotary_base=float(model.get("rope_theta", 10000.0)), **yarn,
        normalization="RMSNorm", layernorm_epsilon=float(model["rms_norm_eps"]), qk_layernorm=True,
        attention_backend=AttnBackend.local,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_ffn_hidden_size=model["moe_intermediate_size"], moe_router_topk=topk,
        moe_layer_freq=[0] * dense + [1] * (layers - dense),
        moe_shared_expert_intermediate_size=(model["moe_intermediate_size"] * model["n_shared_experts"]
                                             if model.get("n_shared_experts") else None),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=float(model.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        moe_router_dtype=router_dtype, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        expert_model_parallel_size=expert_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, sequence_parallel=False)
    return config, knobs


def build_model(config, model_cfg: dict, device: torch.device, core_attention=MLADotProductAttention):
    """``GPTModel`` on the local block spec, every layer's core attention swapped for ``MLADotProductAttention``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    spec.layer_specs = [copy.deepcopy(s) for s in spec.layer_specs]
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = core_attention
    spec.layer_norm = WrappedTorchNorm
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=model_cfg["vocab_size"],
                     max_sequence_length=int(model_cfg.get("max_position_embeddings", 4096)), pre_process=True,
                     post_process=True, parallel_output=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    # Every parameter in the case dtype, as Megatron's Float16Module does for bf16 (module.bfloat16()): the local
    # WrappedTorchNorm creates fp32 norm weights. Buffers loaded from the checkpoint keep its dtype (load_weights).
    return model.to(device=device, dtype=config.params_dtype)


# ---------------------------------------------------------------------------------------------- name map

def name_map(moe_layers: list[int], dense_layers: list[int], experts: int, section: str = "megatron") -> dict:
    """The TOML section expanded for this model: {"parameters": {canonical: (megatron, [checkpoint names])},
    "buffers": {...same...}, "modules": {canonical: megatron}, "not_captured": {canonical: why}}."""
    data = tomllib.loads(NAME_MAP.read_text())[section]
    groups = {"model": [{}], "layer": [{"L": L} for L in sorted(dense_layers + moe_layers)],
              "dense": [{"L": L} for L in dense_layers], "moe": [{"L": L} for L in moe_layers],
              "expert": [{"L": L, "E": E} for L in moe_layers for E in range(experts)]}
    out = {}
    for kind in ("parameters", "buffers", "modules", "not_captured"):
        table = {}
        for group, entries in data.get(kind, {}).items():
            for group_subst in groups[group]:
                for canonical, target in entries.items():
                    expand = "{E}" in canonical and "E" not in group_subst  # per expert of a layer
                    for subst in ([dict(group_subst, E=E) for E in range(experts)] if expand else [group_subst]):
                        key = canonical.format(**subst)
                        if kind == "not_captured":
                            table[key] = target
                        elif kind == "modules":
                            table[key] = target.format(**subst)
                        elif isinstance(target, str):
                            table[key] = (target.format(**subst), [key])
                        else:
                            table[key] = (target["name"].format(**subst),
                                          [n.format(**subst) for n in target["cat0"]])
        out[kind] = table
    return out


def load_weights(model, names: dict, tensors: dict) -> None:
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    expected = {m for m, _ in names["parameters"].values()}
    missing = sorted(set(params) - expected)
    if missing:
        raise RuntimeError(f"Megatron parameters without a name-map entry: {missing[:8]} ...")
    with torch.no_grad():
        for kind, table, store in (("parameter", names["parameters"], params), ("buffer", names["buffers"], buffers)):
            for canonical, (megatron, sources) in table.items():
                if megatron not in store:
                    raise RuntimeError(f"name map: {kind} {megatron!r} (for {canonical!r}) not in the Megatron model")
                value = torch.cat([tensors[s] for s in sources], dim=0)
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

    def __init__(self, model, modules: dict[str, str]):
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = []
        named = dict(model.named_modules())
        for canonical, target in modules.items():
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
                self.outputs[f"module.{canonical}.probs"] = probs.detach().clone()
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
        self.outputs[f"module.{canonical}"] = tensor

    def remove(self):
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------- run

def layer_kinds(model_cfg: dict) -> tuple[list[int], list[int]]:
    dense = int(model_cfg.get("first_k_dense_replace", 0))
    layers = model_cfg["num_hidden_layers"]
    return list(range(min(dense, layers))), list(range(dense, layers))


# MultiLatentAttention.forward calls self.core_attention(query, key, value, attention_mask, packed_seq_params=...,
# attn_mask_type=...): megatron-core 0.16.1 as installed, and NVIDIA/Megatron-LM
# megatron/core/transformer/multi_latent_attention.py @ 003b4ce2615f4e501ecbc39e01e0f76d237a35d9.
CORE_ATTENTION_ARGUMENTS = ("query", "key", "value")
ROUTER_WHY = ("Megatron's TopKRouter returns (probs, routing_map), not one hidden-state tensor: it is recomputed "
              "inside the MoE block from side a's input")


def refeed_hooks(model, names: dict, request: dict):
    """harness.capture.torch.Refeed over the canonical modules that are one Megatron module each (hidden states
    [s, b, h]: batch dim 1), the output layer as lm_head; (the Refeed, the units, {canonical: why not re-fed})."""
    import re

    from harness.capture.torch import Refeed

    units = {c: [t] for c, t in names["modules"].items() if not t.startswith("pre:") and not c.endswith(".mlp.gate")}
    units["lm_head"] = ["output_layer"]
    experts = {re.sub(r"\.experts\.\d+$", ".experts.{E}", c): why for c, why in names["not_captured"].items()}
    not_refed = {**experts, **{c: ROUTER_WHY for c in names["modules"] if c.endswith(".mlp.gate")}}
    # MLASelfAttention calls core_attention(query, key, value, attention_mask, ...): all three are replaced, so a
    # difference made before them (RoPE, the kv up-projection's split) shows in their rows, not in core attention's
    attention = {c: CORE_ATTENTION_ARGUMENTS for c in units if c.endswith(".self_attn.core_attention")}
    return (Refeed(model, units, request["mode"], request.get("from"), batch_dim=1, arguments=attention), units,
            not_refed)


def forward_backward(model, names, tensors, device, phases, loss_path: str = "megatron", refeed: dict | None = None):
    """Forward with labels (Megatron's per-token cross entropy), masked mean, backward. ``loss_path="float64_logits"``
    is for tests only: the loss from the logits in their own dtype (no fp32 island), to prove the gradient mapping."""
    input_ids = tensors["input_ids"].to(device).view(1, -1)
    labels = tensors["labels"].to(device).view(1, -1)
    t = input_ids.shape[1]
    loss_mask = (labels != IGNORE_INDEX)
    safe_labels = torch.where(loss_mask, labels, torch.zeros_like(labels))  # masked out below (loss_mask)
    position_ids = torch.arange(t, device=device).view(1, -1)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1).view(1, 1, t, t)
    capture = Capture(model, names["modules"])
    logits_box = {}
    # A copy: vocab_parallel_cross_entropy subtracts the max and exponentiates fp32 logits in place.
    hook = model.output_layer.register_forward_hook(
        lambda m, a, o: logits_box.__setitem__("logits", o[0].detach().clone()))
    replay = refeed_hooks(model, names, refeed) if refeed else None  # after capture: its hooks see local tensors
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
    if replay:
        hooks, units, not_refed = replay
        refeed.update(tensors=hooks.finish(), meta={**hooks.meta(), "units": list(units),
                                                    "not_refed": {**not_refed, **hooks.not_refed}})
    outputs = {"loss": loss.detach(), "logits": logits_box["logits"].detach().squeeze(1), **capture.outputs}
    params = dict(model.named_parameters())
    for canonical, (megatron, _) in names["parameters"].items():
        grad = params[megatron].grad
        if grad is None:
            raise RuntimeError(f"no gradient for {megatron} ({canonical})")
        outputs[f"grad.{canonical}"] = grad
    return outputs


def compute(request: dict, phases: Phases, loss_path: str = "megatron", skip_adapters=()):
    """Set up (process group already initialised), run, and return (outputs, meta additions, device)."""
    model_cfg = request["config"]["model"]
    dtype = DTYPES[request["dtype"]]
    with phases("setup"):
        device = torch_env.select_device(request["device"], int(os.environ.get("LOCAL_RANK", 0)))
        determinism = torch_env.apply_determinism(device)
        adapters = install_adapters(device, skip_adapters)
        config, knobs = translate_config(model_cfg, dtype, device)
        model = build_model(config, model_cfg, device, DotProductAttention if "MLADotProductAttention" in
                            skip_adapters else MLADotProductAttention)
        dense_layers, moe_layers = layer_kinds(model_cfg)
        names = name_map(moe_layers, dense_layers, model_cfg["n_routed_experts"])
        tensors = torch_env.load_inputs(request["checkpoint"], device)
        load_weights(model, names, tensors)
        model.train()
    refeed = dict(request["config"]["refeed"]) if request["config"].get("refeed") else None
    outputs = forward_backward(model, names, tensors, device, phases, loss_path, refeed)
    # Megatron's cross entropy is float32 whatever the model dtype; a float64 case gets it exactly upcast.
    outputs["loss"] = outputs["loss"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    meta = {"implementation": "megatron.core.models.gpt.GPTModel, local spec (no TE): MLASelfAttention "
                              "(MLADotProductAttention), MoELayer(TopKRouter, SequentialMLP, SharedExpertMLP), "
                              "WrappedTorchNorm RMSNorm, vocab_parallel_cross_entropy",
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
        raise Unsupported(f"megatron_model runs ops causal_lm and causal_lm_train only (got {request['op']!r})")
    if int(request.get("tp", 1)) != 1:
        raise Unsupported("megatron_model runs at tensor-parallel size 1 only")
    _, world = rank_and_world()
    if request["op"] == "causal_lm" and world != 1:  # a training run checks its train.dp ranks itself
        raise Unsupported("megatron_model runs op causal_lm on one rank only")


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

    return {"framework": "megatron-core", "versions": {"megatron-core": megatron_version, **te_version()}, **meta,
            "tensor_parallel": 1, "distributed_backend": "nccl" if device.type == "cuda" else "gloo",
            **torch_env.provenance(device)}


def init_process_group(device: torch.device, gloo_groups: bool = False) -> None:
    """Gloo on the CPU, NCCL on a GPU, world size 1 (the existing Megatron runner's setup)."""
    from harness.runners.megatron.runner import init_process_group

    if not dist.is_initialized():
        init_process_group(device, gloo_groups)
