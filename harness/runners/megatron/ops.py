"""Megatron-Core's implementation of every op, keyed by the op record (``IMPLEMENTATIONS``), no TE.

Each function takes (request, tensors, config, device, phases) and returns (outputs, implementation) in
canonical names and layout. The modules are Megatron-Core's own; the runner only feeds them and reads grads.
SwiGLU: ``swiglu_impl = "fused"`` (default) is ``bias_swiglu_impl`` (``SwiGLUFunction``: a hand-written
backward), ``"eager"`` is Megatron's ``swiglu`` under autograd. Both run eagerly: ``jit_fuser`` is
``torch.compile``, which the runner disables (``TORCHDYNAMO_DISABLE=1``), so the compiled numerics are not
what is measured here.
"""

from __future__ import annotations

import torch

from harness.case import ops
from harness.run.cell_state import patch
from harness.runners.torch import env as torch_env


def _transformer_config(request, config, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    shapes = request["shapes"]
    hidden = shapes.get("hidden_size", 2 * shapes.get("ffn_hidden_size", 1))
    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, use_cpu_initialization=config.use_cpu_initialization,
        perform_initialization=False, params_dtype=config.params_dtype, bf16=config.params_dtype == torch.bfloat16,
        gradient_accumulation_fusion=False, add_bias_linear=False, **overrides)


def _run(phases, device, forward, backward):
    with phases("forward"):
        out = forward()
        torch_env.synchronize(device)
    with phases("backward"):
        backward(out)
        torch_env.synchronize(device)
    return out


def parallel_linear(request, tensors, config, device, phases):
    """ColumnParallelLinear or RowParallelLinear on this rank's shards: out = x @ W.t() (+ b), then backward."""
    from megatron.core import tensor_parallel

    bias = request["config"]["bias"]
    n_in, n_out = request["shapes"]["input_size"], request["shapes"]["output_size"]
    common = dict(config=config, init_method=torch.nn.init.zeros_, bias=bias, skip_bias_add=False)
    if request["op"] == "column_parallel_linear":
        layer = tensor_parallel.ColumnParallelLinear(n_in, n_out, gather_output=False, **common)
    else:
        layer = tensor_parallel.RowParallelLinear(n_in, n_out, input_is_parallel=True, **common)
    layer = layer.to(device)
    with torch.no_grad():
        layer.weight.copy_(tensors["weight"])
        if bias:
            layer.bias.copy_(tensors["bias"])
    x = tensors["input"].unsqueeze(1).requires_grad_()  # [tokens, batch=1, hidden]: Megatron's [s, b, h]
    with phases("forward"):
        out, _ = layer(x)
        torch_env.synchronize(device)
    with phases("backward"):
        out.backward(tensors["grad_output"].unsqueeze(1))
        torch_env.synchronize(device)
    outputs = {"out": out.squeeze(1), "grad.input": x.grad.squeeze(1), "grad.weight": layer.weight.grad}
    if bias:
        outputs["grad.bias"] = layer.bias.grad
    return outputs, f"megatron.core.tensor_parallel.{type(layer).__name__} (no Transformer Engine)"


def rms_norm(request, tensors, config, device, phases):
    """``WrappedTorchNorm`` with normalization="RMSNorm" (a ``torch.nn.RMSNorm``), weight in the params dtype
    as Megatron's mixed-precision wrapper leaves it."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    eps = request["config"]["eps"]
    tconfig = _transformer_config(request, config, normalization="RMSNorm", layernorm_epsilon=eps)
    norm = WrappedTorchNorm(tconfig, request["shapes"]["hidden_size"], eps=eps).to(device=device,
                                                                                  dtype=config.params_dtype)
    with torch.no_grad():
        norm.weight.copy_(tensors["weight"])
    x = tensors["input"].requires_grad_()
    out = _run(phases, device, lambda: norm(x), lambda o: o.backward(tensors["grad_output"]))
    return ({"out": out, "grad.input": x.grad, "grad.weight": norm.weight.grad},
            f"megatron.core.transformer.torch_norm.WrappedTorchNorm -> {type(norm).__module__}.{type(norm).__name__}"
            f" (weight {norm.weight.dtype})")


def swiglu(request, tensors, config, device, phases):
    from megatron.core.fusions import fused_bias_swiglu as fused

    impl = request["config"]["swiglu_impl"]
    x = tensors["input"].requires_grad_()
    scale = tensors.get("per_token_scale")
    if scale is not None:  # MLP passes per_token_scale.unsqueeze(-1) to weighted_bias_swiglu_impl
        scale = scale.unsqueeze(-1).requires_grad_()
        if impl == "fused":
            def forward():
                return fused.weighted_bias_swiglu_impl(x, None, scale)
            name = "megatron.core.fusions.fused_bias_swiglu.weighted_bias_swiglu_impl (WeightedSwiGLUFunction)"
        else:
            def forward():
                return fused.weighted_swiglu(x, scale)
            name = "megatron.core.fusions.fused_bias_swiglu.weighted_swiglu under autograd (eager)"
    elif impl == "fused":
        def forward():
            return fused.bias_swiglu_impl(x, None)
        name = "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl (SwiGLUFunction, hand-written backward)"
    else:
        def forward():
            return fused.swiglu(x)
        name = "megatron.core.fusions.fused_bias_swiglu.swiglu under autograd (eager)"
    out = _run(phases, device, forward, lambda o: o.backward(tensors["grad_output"]))
    outputs = {"out": out, "grad.input": x.grad}
    if scale is not None:
        outputs["grad.per_token_scale"] = scale.grad.squeeze(-1)
    return outputs, name + "; jit_fuser disabled (TORCHDYNAMO_DISABLE=1): eager numerics"


def embedding(request, tensors, config, device, phases):
    """``VocabParallelEmbedding`` at TP=1: ``F.embedding``, or ``weight[ids]`` with config.deterministic_mode."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    deterministic = request["config"]["deterministic_mode"]
    config.deterministic_mode = deterministic
    vocab, hidden = request["shapes"]["vocab_size"], request["shapes"]["hidden_size"]
    layer = VocabParallelEmbedding(vocab, hidden, init_method=torch.nn.init.zeros_, config=config).to(device)
    with torch.no_grad():
        layer.weight.copy_(tensors["weight"])
    ids = tensors["ids"].unsqueeze(0)  # [batch=1, tokens], as GPT's embedding calls it
    out = _run(phases, device, lambda: layer(ids), lambda o: o.backward(tensors["grad_output"].unsqueeze(0)))
    lookup = "weight[ids]" if deterministic else "F.embedding"
    return ({"out": out.squeeze(0), "grad.weight": layer.weight.grad},
            f"megatron.core.tensor_parallel.VocabParallelEmbedding ({lookup}; deterministic_mode={deterministic})")


def shared_expert_mlp(request, tensors, config, device, phases):
    """``SharedExpertMLP`` (fc1 -> SwiGLU -> fc2, no gate); intermediates captured by hooks on its own submodules."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    ffn = request["shapes"]["ffn_hidden_size"]
    fused = request["config"]["swiglu_impl"] == "fused"
    tconfig = _transformer_config(request, config, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                  bias_activation_fusion=fused, num_moe_experts=2,
                                  moe_shared_expert_intermediate_size=ffn, ffn_hidden_size=ffn)
    mlp = SharedExpertMLP(tconfig, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                          gate=False, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(tensors["fc1_weight"])
        mlp.linear_fc2.weight.copy_(tensors["fc2_weight"])
    captured = {}

    def keep(name):
        def hook(grad):
            captured[name] = grad
        return hook

    def after_fc1(module, args, output):
        captured["intermediate.fc1_out"] = output[0]
        output[0].register_hook(keep("intermediate.grad_fc1_out"))

    def before_fc2(module, args):
        captured["intermediate.act_out"] = args[0]
        args[0].register_hook(keep("intermediate.grad_act_out"))

    mlp.linear_fc1.register_forward_hook(after_fc1)
    mlp.linear_fc2.register_forward_pre_hook(before_fc2)
    x = tensors["input"].unsqueeze(1).requires_grad_()  # [s, b=1, h]
    out = _run(phases, device, lambda: mlp(x),
               lambda o: o.backward(tensors["grad_output"].unsqueeze(1)))
    outputs = {name: t.squeeze(1) for name, t in captured.items()}
    outputs.update({"out": out.squeeze(1), "grad.input": x.grad.squeeze(1),
                    "grad.fc1_weight": mlp.linear_fc1.weight.grad, "grad.fc2_weight": mlp.linear_fc2.weight.grad})
    act = "bias_swiglu_impl (fused, hand-written backward)" if fused else "glu: silu(gate) * up (eager autograd)"
    return outputs, f"megatron.core.transformer.moe.shared_experts.SharedExpertMLP, activation {act}, no TE"


def moe_router(request, tensors, config, device, phases):
    """``TopKRouter``: fp32 gating GEMM (``RouterGatingLinearFunction``), sigmoid scores, expert bias for the
    choice only, top-k, normalisation over the k, scaling. Load-balancing losses off: they add grads of their own."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(moe_utils, "te_general_gemm", None) is None:
        patch(moe_utils, "te_general_gemm", None)  # 0.16.1 references it unguarded without Transformer Engine
    if device.type == "cpu":
        patch(torch.cuda, "current_device", lambda: torch.device("cpu"))  # the router's buffers go "on the GPU"
    shapes = request["shapes"]
    tconfig = _transformer_config(
        request, config, num_moe_experts=shapes["num_experts"], moe_router_topk=shapes["topk"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=request["config"]["topk_scaling_factor"],
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    router = TopKRouter(tconfig, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    with torch.no_grad():
        router.weight.copy_(tensors["weight"])  # in the params dtype, as reset_parameters leaves it
        router.expert_bias.copy_(tensors["expert_bias"])
    x = tensors["input"].unsqueeze(1).requires_grad_()  # [s, b=1, h]
    probs, routing_map = _run(phases, device, lambda: router(x), lambda o: o[0].backward(tensors["grad_probs"]))
    indices = torch.sort(torch.nonzero(routing_map)[:, 1].view(routing_map.shape[0], -1), dim=-1).values
    return ({"topk_indices": indices, "probs": probs, "grad.input": x.grad.squeeze(1),
             "grad.weight": router.weight.grad},
            "megatron.core.transformer.moe.router.TopKRouter (sigmoid, expert bias, fp32 router dtype, "
            "torch.mm gating without Transformer Engine)")


def attention_scores(request, tensors, config, device, phases):
    """QK^T as ``DotProductAttention`` computes it (``torch.baddbmm``, alpha = 1/sqrt(head_dim)), then Megatron's
    ``FusedScaleMaskSoftmax`` on its unfused path: fp32 softmax, output cast back; the causal mask is explicit
    (``get_default_causal_mask`` hard-codes CUDA)."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    n, d = request["shapes"]["num_heads"], request["shapes"]["head_dim"]
    t = tensors["query"].shape[0]
    softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=config.params_dtype == torch.bfloat16,
                                    attn_mask_type=AttnMaskType.causal, scaled_masked_softmax_fusion=False,
                                    mask_func=attention_mask_func, softmax_in_fp32=True, scale=None)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1).view(1, 1, t, t)
    q, k = tensors["query"].requires_grad_(), tensors["key"].requires_grad_()
    captured = {}

    def forward():
        buffer = torch.empty(n, t, t, dtype=q.dtype, device=device)
        scores = torch.baddbmm(buffer, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=1.0 / d ** 0.5)
        captured["intermediate.scores"] = scores.detach().clone()  # the fp32 path masks it in place
        return softmax(scores.view(1, n, t, t), mask).view(n, t, t)

    out = _run(phases, device, forward, lambda o: o.backward(tensors["grad_output"]))
    return ({**captured, "out": out, "grad.query": q.grad, "grad.key": k.grad},
            "torch.baddbmm as megatron DotProductAttention, then megatron.core.fusions.fused_softmax."
            "FusedScaleMaskSoftmax (unfused torch path, softmax_in_fp32, explicit causal mask)")


def routed_experts(request, tensors, config, device, phases):
    """``SequentialMLP`` (no TE): one ``MLP`` per local expert on its slice of the permuted tokens, the routing
    probability applied inside the activation (``weighted_bias_swiglu_impl``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from harness.case.ops import uneven_split

    shapes = request["shapes"]
    experts, ffn = shapes["num_local_experts"], shapes["ffn_hidden_size"]
    tconfig = _transformer_config(request, config, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                  bias_activation_fusion=True, num_moe_experts=experts, moe_ffn_hidden_size=ffn,
                                  ffn_hidden_size=ffn)
    mlp = SequentialMLP(experts, tconfig, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    with torch.no_grad():
        for i, expert in enumerate(mlp.local_experts):
            expert.linear_fc1.weight.copy_(tensors["fc1_weight"][i])
            expert.linear_fc2.weight.copy_(tensors["fc2_weight"][i])
    counts = uneven_split(tensors["input"].shape[0], experts)
    x, probs = tensors["input"].requires_grad_(), tensors["probs"].requires_grad_()
    out, _ = _run(phases, device, lambda: mlp(x, torch.tensor(counts), probs),
                  lambda o: o[0].backward(tensors["grad_output"]))
    return ({"out": out, "grad.input": x.grad, "grad.probs": probs.grad,
             "grad.fc1_weight": torch.stack([e.linear_fc1.weight.grad for e in mlp.local_experts]),
             "grad.fc2_weight": torch.stack([e.linear_fc2.weight.grad for e in mlp.local_experts])},
            f"megatron.core.transformer.moe.experts.SequentialMLP, tokens per expert {counts}, "
            "weighted_bias_swiglu_impl, no TE")


def mla_up_projection(request, tensors, config, device, phases):
    """MLA's q/kv up-projection as ``MLASelfAttention`` runs it: a ``ColumnParallelLinear`` (lora rank -> heads x
    head dim, no bias, gather_output=False) whose output is viewed as [s, b, heads on this rank, head_dim]."""
    from megatron.core import tensor_parallel

    shapes = request["shapes"]
    layer = tensor_parallel.ColumnParallelLinear(
        shapes["lora_rank"], shapes["num_heads"] * shapes["head_dim"], config=config,
        init_method=torch.nn.init.zeros_, bias=False, gather_output=False, skip_bias_add=False).to(device)
    with torch.no_grad():
        layer.weight.copy_(tensors["weight"])
    x = tensors["input"].unsqueeze(1).requires_grad_()  # [s, b=1, lora rank]
    dy = tensors["grad_output"].unsqueeze(1)  # [s, b=1, heads on this rank, head_dim]
    out = _run(phases, device, lambda: layer(x)[0].view(*dy.shape), lambda out: out.backward(dy))
    return ({"out": out.squeeze(1), "grad.input": x.grad.squeeze(1), "grad.weight": layer.weight.grad},
            "megatron.core.tensor_parallel.ColumnParallelLinear viewed per head, as MLASelfAttention's "
            "linear_q_up_proj / linear_kv_up_proj (no Transformer Engine)")


# The patches an implementation applied in this cell (undone when it ends); the runner writes them to meta.json
# ("shims") and clears the list before each cell.
SHIMS: list[str] = []


def _cpu_current_device(device):
    """Megatron asks torch.cuda.current_device() for buffers it means to put on "the GPU" (YaRN's inv_freq,
    the global memory buffer attention's QK^T writes into): on a CPU-only run that must name the CPU."""
    if device.type == "cpu":
        patch(torch.cuda, "current_device", lambda: "cpu")
        SHIMS.append("CPU only: torch.cuda.current_device() returns 'cpu' (YarnRotaryEmbedding moves inv_freq to "
                     "it; DotProductAttention's global memory buffer is allocated on it)")
        return "; CPU shim: torch.cuda.current_device() -> 'cpu'"
    return ""


def yarn_rope(request, tensors, config, device, phases):
    """MLA's rope path: ``YarnRotaryEmbedding`` (Kimi-K2's settings from the knobs) makes the fp32 angle table and
    its concentration factor (mscale); ``apply_rotary_pos_emb`` (unfused bshd path, MLA's de-interleave of each
    head's rope dims) rotates q_pe [s, b, heads, 64] and k_pe [s, b, 1, 64]; k_pe is then expanded to every head as
    ``MLASelfAttention`` does, so its grad is the expand's sum over heads."""
    import inspect

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    shim = _cpu_current_device(device)
    c, n, d = request["config"], request["shapes"]["num_heads"], request["shapes"]["rope_dim"]
    rope = YarnRotaryEmbedding(d, rotary_base=c["rotary_base"], scaling_factor=c["rotary_scaling_factor"],
                               original_max_position_embeddings=c["original_max_position_embeddings"],
                               beta_fast=c["beta_fast"], beta_slow=c["beta_slow"], mscale=c["mscale"],
                               mscale_all_dim=c["mscale_all_dim"], use_cpu_initialization=device.type == "cpu")
    tconfig = _transformer_config(request, config, multi_latent_attention=True, apply_rope_fusion=False,
                                  rotary_interleaved=False)
    # 0.16.1 reads config.multi_latent_attention; 0.19 takes mla_rotary_interleaved=True from MLASelfAttention.
    mla = {"mla_rotary_interleaved": True} if "mla_rotary_interleaved" in inspect.signature(
        apply_rotary_pos_emb).parameters else {}
    t = tensors["query"].shape[0]
    q = tensors["query"].unsqueeze(1).requires_grad_()  # [s, b=1, heads, 64]
    k = tensors["key"].view(t, 1, 1, d).requires_grad_()  # [s, b=1, 1, 64]
    captured = {}

    def forward():
        freqs, mscale = rope(t)
        freqs = freqs[0:t]  # [s, 1, 1, 64], fp32
        captured["intermediate.freqs"], captured["mscale"] = freqs.view(t, d), mscale
        q_out = apply_rotary_pos_emb(q, freqs, config=tconfig, mscale=mscale, **mla)
        k_out = apply_rotary_pos_emb(k, freqs, config=tconfig, mscale=mscale, **mla)
        captured["out.key"] = k_out.view(t, d)
        return q_out, k_out.expand(-1, -1, n, -1)

    def backward(outs):
        torch.autograd.backward(outs, [tensors["grad_query"].unsqueeze(1), tensors["grad_key"].unsqueeze(1)])

    q_out, _ = _run(phases, device, forward, backward)
    cos, sin = rope.get_cached_cos_sin(t, dtype=q.dtype)  # the fused path's tables: (cos(emb) * mscale).to(dtype)
    return ({"intermediate.freqs": captured["intermediate.freqs"], "intermediate.cos": cos.reshape(t, d),
             "intermediate.sin": sin.reshape(t, d), "out.query": q_out.squeeze(1),
             "out.key": captured["out.key"], "grad.query": q.grad.squeeze(1), "grad.key": k.grad.view(t, d)},
            "megatron.core YarnRotaryEmbedding + rope_utils.apply_rotary_pos_emb (unfused bshd, MLA de-interleave, "
            f"mscale {captured['mscale']}), k_pe expanded to {n} heads as MLASelfAttention{shim}")


def core_attention(request, tensors, config, device, phases):
    """Megatron's local ``DotProductAttention`` (no TE) as MLA would run it: QK^T by ``baddbmm`` with the softmax
    scale as alpha, ``FusedScaleMaskSoftmax`` (unfused path, fp32 softmax, masked_fill -10000, cast back), dropout
    p=0 under the RNG tracker's fork, probabilities x V by ``bmm``. kv_channels is the v head dim (128): the module
    uses it only for the output view, so q/k keep their own 192. The causal mask is explicit
    (``get_default_causal_mask`` hard-codes CUDA); the RNG tracker is the inference (no-op) one."""
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    shim = _cpu_current_device(device)
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    shapes = request["shapes"]
    n, dv = shapes["num_heads"] * config.tensor_model_parallel_size, shapes["v_head_dim"]
    tconfig = TransformerConfig(
        num_layers=1, hidden_size=n * dv, num_attention_heads=n, kv_channels=dv,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        use_cpu_initialization=config.use_cpu_initialization, perform_initialization=False,
        params_dtype=config.params_dtype, bf16=config.params_dtype == torch.bfloat16, attention_dropout=0.0,
        masked_softmax_fusion=False, attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        gradient_accumulation_fusion=False, add_bias_linear=False)
    scale = request["config"]["softmax_scale"]
    attention = DotProductAttention(tconfig, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self", softmax_scale=scale).to(device)
    t = tensors["query"].shape[0]
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1).view(1, 1, t, t)
    q, k, v = (tensors[name].unsqueeze(1).requires_grad_() for name in ("query", "key", "value"))  # [s, b=1, n, d]
    captured = {}

    def keep_probs(module, args, output):
        captured["intermediate.probs"] = output.detach().clone().squeeze(0)

        def hook(grad):
            captured["intermediate.grad_probs"] = grad.squeeze(0)
        output.register_hook(hook)

    attention.scale_mask_softmax.register_forward_hook(keep_probs)
    heads = tensors["query"].shape[1]
    out = _run(phases, device, lambda: attention(q, k, v, mask),
               lambda o: o.backward(tensors["grad_output"].reshape(t, 1, heads * dv)))
    return ({**captured, "out": out.view(t, heads, dv), "grad.value": v.grad.squeeze(1),
             "grad.query": q.grad.squeeze(1), "grad.key": k.grad.squeeze(1)},
            "megatron.core.transformer.dot_product_attention.DotProductAttention (local, no TE): baddbmm "
            f"alpha={scale!r}, FusedScaleMaskSoftmax unfused fp32, bmm; explicit causal mask{shim}")


def moe_combine(request, tensors, config, device, phases):
    """The MoE layer's combine: the token dispatcher's ``unpermute`` (moe_utils; no probs: they were applied in
    the experts) sums each token's routed outputs into a zero tensor in the experts' dtype (``index_add_`` under
    deterministic algorithms, else ``scatter_add_``), in expert-major order; then ``MoELayer`` adds the shared
    expert's output (``output + shared_expert_output``). The permutation is Megatron's own ``permute``."""
    from megatron.core.transformer.moe import moe_utils

    from harness.case.ops import combine_routing

    shapes, t = request["shapes"], tensors["shared_output"].shape[0]
    routing_map = torch.zeros(t, shapes["num_experts"], dtype=torch.bool, device=device)
    for token, experts in enumerate(combine_routing(t, shapes["num_experts"], shapes["topk"])):
        routing_map[token, experts] = True
    sorted_indices = moe_utils.permute(torch.zeros(t, 1, device=device), routing_map,
                                       num_out_tokens=t * shapes["topk"])[2]
    routed, shared = tensors["expert_output"].requires_grad_(), tensors["shared_output"].requires_grad_()

    def forward():
        output = moe_utils.unpermute(routed, sorted_indices, restore_shape=torch.Size(shared.shape),
                                     routing_map=routing_map)
        return output + shared

    out = _run(phases, device, forward, lambda o: o.backward(tensors["grad_output"]))
    accumulate = "index_add_" if torch.are_deterministic_algorithms_enabled() else "scatter_add_"
    return ({"out": out, "grad.expert_output": routed.grad, "grad.shared_output": shared.grad},
            f"megatron.core.transformer.moe.moe_utils.unpermute (no probs, {accumulate} in {routed.dtype}, "
            "expert-major order) + shared expert output, as MoELayer")


def lm_head_loss(request, tensors, config, device, phases):
    """GPT's output layer (``ColumnParallelLinear``, no bias, parallel output) and
    ``tensor_parallel.vocab_parallel_cross_entropy`` (logits upcast to fp32 inside; its backward returns fp32,
    cast to the logits' dtype by autograd), then the training loop's mean: sum(loss x loss_mask) / tokens."""
    from megatron.core import tensor_parallel

    shapes = request["shapes"]
    layer = tensor_parallel.ColumnParallelLinear(
        shapes["hidden_size"], shapes["vocab_size"], config=config, init_method=torch.nn.init.zeros_, bias=False,
        gather_output=False, skip_bias_add=False).to(device)
    with torch.no_grad():
        layer.weight.copy_(tensors["weight"])
    x = tensors["input"].unsqueeze(1).requires_grad_()  # [s, b=1, h]
    labels = tensors["labels"].unsqueeze(1)  # [s, b=1]
    captured = {}

    def forward():
        logits, _ = layer(x)
        # clones: with fp32 logits the cross entropy's .float() is the same tensor, which it then shifts and
        # exponentiates in place (and its backward returns that buffer as the grad)
        captured["intermediate.logits"] = logits.detach().squeeze(1).clone()

        def hook(grad):
            captured["intermediate.grad_logits"] = grad.squeeze(1).clone()
        logits.register_hook(hook)
        token_loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        captured["out"] = token_loss.detach().squeeze(1)
        loss_mask = torch.ones(labels.numel(), dtype=torch.float32, device=device)
        return torch.sum(token_loss.view(-1).float() * loss_mask) / loss_mask.sum()

    loss = _run(phases, device, forward, lambda o: o.backward())
    return ({**captured, "loss": loss.detach().view(1), "grad.input": x.grad.squeeze(1),
             "grad.weight": layer.weight.grad},
            "megatron.core.tensor_parallel.ColumnParallelLinear (output layer) + vocab_parallel_cross_entropy, "
            "loss = sum(token_loss * mask) / mask.sum()")


IMPLEMENTATIONS = {
    ops.COLUMN_PARALLEL_LINEAR: parallel_linear, ops.ROW_PARALLEL_LINEAR: parallel_linear, ops.RMS_NORM: rms_norm,
    ops.SWIGLU: swiglu, ops.EMBEDDING: embedding, ops.MOE_ROUTER: moe_router, ops.ATTENTION_SCORES: attention_scores,
    ops.SHARED_EXPERT_MLP: shared_expert_mlp, ops.ROUTED_EXPERTS: routed_experts,
    ops.MLA_UP_PROJECTION: mla_up_projection, ops.YARN_ROPE: yarn_rope, ops.CORE_ATTENTION: core_attention,
    ops.MOE_COMBINE: moe_combine, ops.LM_HEAD_LOSS: lm_head_loss,
}
