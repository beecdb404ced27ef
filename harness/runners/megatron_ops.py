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
from harness.runners import torch_env


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
        moe_utils.te_general_gemm = None  # 0.16.1 references it unguarded without Transformer Engine
    if device.type == "cpu":
        torch.cuda.current_device = lambda: torch.device("cpu")  # the router places its buffers "on the GPU"
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


IMPLEMENTATIONS = {
    ops.COLUMN_PARALLEL_LINEAR: parallel_linear, ops.ROW_PARALLEL_LINEAR: parallel_linear, ops.RMS_NORM: rms_norm,
    ops.SWIGLU: swiglu, ops.EMBEDDING: embedding, ops.MOE_ROUTER: moe_router, ops.ATTENTION_SCORES: attention_scores,
    ops.SHARED_EXPERT_MLP: shared_expert_mlp, ops.ROUTED_EXPERTS: routed_experts,
    ops.MLA_UP_PROJECTION: mla_up_projection,
}
