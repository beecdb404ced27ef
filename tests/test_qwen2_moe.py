"""The Qwen2-MoE family (harness/families/qwen2_moe) without running a whole model (bar one tiny Paddle run): its typed
config (Qwen1.5-MoE-A2.7B's defaults, errors naming key and value), its layout (269 gradients for the 2-layer case, q,
k and v with their biases, the shared expert and its gate), its name maps (q, k and v weights and biases interleaved
per query group in Megatron's linear_qkv and Paddle's qkv_proj; the shared expert's gate Megatron's
SharedExpertMLP.gate_weight), the Megatron builder's settings, the routing (HF's and Megatron's routers bit-equal on
the same logits: norm_topk_prob false is Megatron's pre_softmax), PaddleFormers' routing as the family records it, and
PaddleFormers' dense layers (every layer or none). The model runs themselves: tests/test_model_e2e.py and
tests/test_train_zoo_e2e.py (tests/support/zoo.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES, family_of
from harness.families.names import NameMap
from tests.support.installed import absent
from tests.support.zoo import assert_config_refused, python_json

Qwen2MoeConfig = FAMILIES["qwen2_moe"].config

TINY = {"family": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128}


@pytest.fixture(scope="module")
def case():
    return Registry.load().get("qwen2_moe_2layer")


# --- the typed config ------------------------------------------------------------------------------------------

def test_defaults_are_qwen15_moe_a27bs_real_values():
    """Qwen/Qwen1.5-MoE-A2.7B's config (60 experts of 1408, top-4, not renormalised, a shared expert of 5632, MHA 16
    heads, q/k/v biases), not PaddleFormers' defaults (rope_theta 10000)."""
    real = Qwen2MoeConfig.resolve({})
    assert real.to_dict() == {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu",
        "use_sliding_window": False, "family": "qwen2_moe"}
    assert Qwen2MoeConfig.from_dict(real.to_dict()) == real and json.loads(json.dumps(real.to_dict())) == \
        real.to_dict()
    assert real.hidden_size // real.num_attention_heads == 128
    assert real.shared_expert_intermediate_size == 4 * real.moe_intermediate_size
    family = family_of("qwen2_moe")
    assert FAMILIES["qwen2_moe"] is family and family.moe_layers(real) == list(range(24))
    assert family.dense_layers(real) == [] and family.buffers(real) == []


@pytest.mark.parametrize("given, problem", [
    ({"num_expertz": 4}, "unknown key 'num_expertz'"),
    ({"head_dim": 16}, "unknown key 'head_dim'"),
    ({"num_attention_heads": 16, "num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ({"hidden_size": 100, "num_attention_heads": 8, "num_key_value_heads": 8},
     "must be a multiple of num_attention_heads"),
    ({"qkv_bias": False}, "qkv_bias must be one of"),
    ({"use_sliding_window": True}, "use_sliding_window must be one of"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings must be one of"),
    ({"norm_topk_prob": 1}, "norm_topk_prob must be bool"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size must be > 0"),
    ({"num_experts_per_tok": 9, "num_experts": 8}, "num_experts_per_tok must be <= num_experts"),
    ({"mlp_only_layers": [2], "num_hidden_layers": 2}, "mlp_only_layers must be distinct layers"),
    ({"mlp_only_layers": 1}, "mlp_only_layers must be a list of int"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be > 0"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "qwen2_moe", Qwen2MoeConfig, given, problem)


# --- the layout ------------------------------------------------------------------------------------------------

def test_the_2layer_case_has_269_gradients_with_q_k_v_biases_and_the_gated_shared_expert(case):
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 269 == 1 + 2 * (13 + 60 * 2) + 2
    for layer in (0, 1):
        p = f"grad.model.layers.{layer}."
        assert {p + f"self_attn.{n}.{w}" for n in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")} <= \
            set(grads)
        assert {p + "mlp.shared_expert.gate_up_proj.weight", p + "mlp.shared_expert.down_proj.weight",
                p + "mlp.shared_expert_gate.weight", p + "mlp.gate.weight"} <= set(grads)
    assert not any("o_proj.bias" in n or "norm" in n and "self_attn" in n for n in grads)  # no o bias, no qk-norm
    shapes = {s.name: s.shape for s in case.output_specs()}
    assert shapes["module.model.layers.0.self_attn.q_proj"] == (64, 256)
    assert shapes["grad.model.layers.0.self_attn.k_proj.bias"] == (256,)
    assert shapes["grad.model.layers.1.mlp.shared_expert.gate_up_proj.weight"] == (2 * 704, 256)
    assert shapes["grad.model.layers.1.mlp.shared_expert_gate.weight"] == (1, 256)
    assert shapes["module.model.layers.1.mlp.shared_expert"] == (64, 256)
    assert shapes["module.model.layers.1.mlp.shared_expert_gate"] == (64, 1)
    assert shapes["module.model.layers.1.mlp.gate.probs"] == (64, 60)
    assert shapes["module.model.layers.1.mlp.gate.topk_indices"] == (64, 4)
    assert shapes["grad.model.layers.0.mlp.experts.5.gate_up_proj.weight"] == (2 * 176, 256)
    family = family_of("qwen2_moe")
    assert family.interleave(case.model) == (16, (16, 16, 16)) and family.buffers(case.model) == []
    assert family.moe_layers(case.model) == [0, 1]


def test_mlp_only_layers_and_the_sparse_step_make_dense_layers_as_hf_reads_them():
    registry = Registry.load()
    dense = registry.get("qwen2_moe_2layer_float64_dense")
    assert not any(".mlp.experts." in s.name or ".mlp.gate." in s.name or "shared_expert" in s.name
                   for s in dense.output_specs())
    grads = {s.name: s.shape for s in dense.output_specs() if s.name.startswith("grad.")}
    assert len(grads) == 1 + 2 * 11 + 2 and grads["grad.model.layers.1.mlp.gate_up_proj.weight"] == (2 * 704, 256)
    family = family_of("qwen2_moe")
    every_other = Qwen2MoeConfig.resolve({**TINY, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                          "mlp_only_layers": [3]})
    assert (family.dense_layers(every_other), family.moe_layers(every_other)) == ([0, 2, 3], [1])


def test_every_case_says_its_pair_and_the_variants_their_dtypes():
    registry = Registry.load()
    cases = {name: registry.get(name) for name in registry.cases if name.startswith("qwen2_moe")}
    assert {n: (c.dtype, c.runners) for n, c in cases.items()} == {
        "qwen2_moe_2layer": ("bfloat16", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_fp32": ("float32", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model")),
        "qwen2_moe_2layer_float64": ("float64", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_float64_dense": ("float64", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "qwen2_moe_2layer_full": ("bfloat16", ("megatron_model", "hf_model")),
        # the training level (cases/qwen2_moe_train.toml)
        "qwen2_moe_2layer_train": ("float32", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_train_bf16": ("bfloat16", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_train_paddle": ("float32", ("megatron_model", "paddle_model")),
        "qwen2_moe_2layer_train_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "qwen2_moe_2layer_train_float64": ("float64", ("megatron_model", "hf_model")),
        "qwen2_moe_2layer_train_float64_dense": ("float64", ("megatron_model", "paddle_model"))}
    full = cases["qwen2_moe_2layer_full"].model
    assert (full.hidden_size, full.num_attention_heads, full.num_key_value_heads, full.intermediate_size,
            full.moe_intermediate_size, full.shared_expert_intermediate_size, full.num_experts,
            full.num_experts_per_tok, full.vocab_size) == (2048, 16, 16, 5632, 1408, 5632, 60, 4, 151936)
    assert cases["qwen2_moe_2layer_full"].devices == ("gpu",)
    small = cases["qwen2_moe_2layer"].model  # the real ratios at reduced widths, every width a multiple of 16
    assert (small.num_attention_heads, small.num_key_value_heads, small.num_experts, small.num_experts_per_tok,
            small.norm_topk_prob) == (full.num_attention_heads, full.num_key_value_heads, full.num_experts,
                                      full.num_experts_per_tok, full.norm_topk_prob)
    for width in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
        assert getattr(small, width) / small.hidden_size == getattr(full, width) / full.hidden_size, width
    head_dim = small.hidden_size // small.num_attention_heads
    assert all(w % 16 == 0 for w in (small.hidden_size, head_dim, small.moe_intermediate_size,
                                      small.shared_expert_intermediate_size, small.intermediate_size))


# --- the name maps ---------------------------------------------------------------------------------------------

def test_paddle_fuses_q_k_v_and_their_biases_per_group_and_transposes_its_routers(case):
    paddle = NameMap.load("qwen2_moe", "paddle", model=case.model)
    rule = paddle.rule("checkpoint", "model.layers.1.self_attn.qkv_proj.weight")
    assert rule.kind == "transpose_interleave" and (rule.groups, rule.widths) == (16, (16, 16, 16))
    assert rule.sources == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    rule = paddle.rule("checkpoint", "model.layers.1.self_attn.qkv_proj.bias")
    assert rule.kind == "interleave" and rule.sources == tuple(f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv")
    rule = paddle.rule("grads", "model.layers.0.self_attn.k_proj.bias")
    assert (rule.kind, rule.sources, rule.index) == ("deinterleave", ("model.layers.0.self_attn.qkv_proj.bias",), 1)
    assert paddle.rule("modules", "model.layers.0.self_attn.v_proj").kind == "deinterleave"
    for name in ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "mlp.shared_expert.down_proj.weight"):
        assert paddle.rule("checkpoint", f"model.layers.1.{name}").kind == "transpose", name
        assert paddle.rule("grads", f"model.layers.1.{name}").kind == "transpose", name
    assert paddle.rule("checkpoint", "model.layers.0.mlp.shared_expert.up_gate_proj.weight").kind == "cat0_transpose"
    assert paddle.rule("checkpoint", "model.layers.0.mlp.experts.3.up_gate_proj.weight").kind == "cat0_transpose"
    assert "top-k slot, token" in paddle.rule("modules", "model.layers.0.mlp.experts.3").why
    assert paddle.rule("modules", "model.layers.0.mlp.shared_expert_gate").kind == "same"
    assert paddle.float64_floor("grad.model.layers.0.self_attn.k_proj.bias", 1e-10) == 2e-6
    assert paddle.float64_floor("grad.model.layers.0.self_attn.k_proj.weight", 1e-10) == 1e-6
    hf = NameMap.load("qwen2_moe", "hf", model=case.model)
    assert hf.rule("checkpoint", "model.layers.1.mlp.experts.gate_up_proj").kind == "stack_cat0"
    assert hf.rule("grads", "model.layers.1.mlp.shared_expert.gate_up_proj.weight").kind == "cat0"
    assert hf.rule("modules", "model.layers.1.mlp.experts.7").kind == "not_captured"
    assert hf.float64_floor("grad.model.layers.0.self_attn.k_proj.weight", 1e-10) == 1e-10  # nothing below float64


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="Megatron's name map is read by its runner")
def test_megatron_map_has_exactly_the_layouts_tensors():
    """linear_qkv's weight, bias and output are q, k and v interleaved (each a deinterleaved part); the shared
    expert's gate is SharedExpertMLP.gate_weight and its logit not captured (no module); the shared expert's output
    before the gate is linear_fc2's; the router's capture is its routing record; no buffer."""
    from harness.runners.megatron.model import name_map

    family = family_of("qwen2_moe")
    for given in (TINY, {**TINY, "mlp_only_layers": [0]}):
        m = Qwen2MoeConfig.resolve(given)
        names = name_map(m)
        assert set(names["parameters"]) == {n[len("grad."):] for n, _ in family.gradients(m)}
        assert names["buffers"] == {}
        routers = {f"model.layers.{L}.mlp.gate" for L in family.moe_layers(m)}
        routing = {f"{r}.{x}" for r in routers for x in ("topk_indices", "probs")}  # both from the router's output
        not_captured = {s.name[len("module."):] for s in family.modules(m, 1)
                        if ".experts." in s.name or s.name.endswith("shared_expert_gate")}
        assert set(names["modules"]) - routers | routing == {
            s.name[len("module."):] for s in family.modules(m, 1)} - not_captured
        assert set(names["not_captured"]) == not_captured
    m = Qwen2MoeConfig.resolve(TINY)
    names = name_map(m)
    bias = names["parameters"]["model.layers.1.self_attn.k_proj.bias"]
    assert bias[0] == "decoder.layers.1.self_attention.linear_qkv.bias" and len(bias[1]) == 3
    assert names["parts"]["model.layers.0.self_attn.v_proj.bias"].widths == (4 * 8, 8, 8)
    assert names["parameters"]["model.layers.1.mlp.shared_expert_gate.weight"][0] == \
        "decoder.layers.1.mlp.shared_experts.gate_weight"
    assert names["modules"]["model.layers.1.mlp.shared_expert"] == "decoder.layers.1.mlp.shared_experts.linear_fc2"
    assert names["modules"]["model.layers.1.mlp.gate"] == "decoder.layers.1.mlp.router.routing_record"


# --- the routing and the shared expert's gate ------------------------------------------------------------------

@pytest.mark.skipif(absent("torch", "megatron.core", "transformers"), reason="both routers")
def test_hf_and_megatron_routers_are_bit_equal_without_the_renormalisation():
    """On the same float32 logits (512 tokens, 60 experts, top-4): HF's Qwen2MoeTopKRouter with norm_topk_prob false
    (softmax over all 60 in float32, top-4) and Megatron's router with pre_softmax true (the builder's mapping of it)
    give the same experts and the same probabilities, bit for bit."""
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Qwen2MoeConfig as HfConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    experts, k = 60, 4
    logits = torch.randn(512, experts, generator=torch.Generator().manual_seed(7)) * 3
    router = Qwen2MoeTopKRouter(HfConfig(hidden_size=experts, num_experts=experts, num_experts_per_tok=k,
                                         norm_topk_prob=False))
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))  # F.linear(x, I) is x, exactly
        _, weights, indices = router(logits)
    hf_probs = torch.zeros_like(logits).scatter(1, indices, weights)
    mg_probs, mg_map = topk_routing_with_score_function(logits, k, use_pre_softmax=True, score_function="softmax")
    assert torch.equal(torch.zeros_like(mg_map).scatter(1, indices, True), mg_map)
    assert torch.equal(hf_probs, mg_probs)


SHARED = """
    import json, torch
    from harness.families import model_config
    from harness.runners.megatron.families import translate_config
    from harness.runners.megatron import model as mm
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from transformers import Qwen2MoeConfig as HfConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    tiny = json.loads(__import__("sys").argv[1])
    mm.init_process_group(torch.device("cpu"))
    m = model_config(tiny)
    config, _ = translate_config(m, torch.float64, torch.device("cpu"))
    shared = SharedExpertMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                             gate=config.moe_shared_expert_gate, pg_collection=get_default_pg_collection()).double()
    block = Qwen2MoeSparseMoeBlock(HfConfig(hidden_size=m.hidden_size, num_experts=m.num_experts,
                                            moe_intermediate_size=m.moe_intermediate_size,
                                            shared_expert_intermediate_size=m.shared_expert_intermediate_size,
                                            num_experts_per_tok=m.num_experts_per_tok)).double()
    g = torch.Generator().manual_seed(5)
    h, f = m.hidden_size, m.shared_expert_intermediate_size
    gate, up, down, gw = (torch.randn(*s, generator=g, dtype=torch.float64) * 0.1
                          for s in ((f, h), (f, h), (h, f), (1, h)))
    with torch.no_grad():
        shared.linear_fc1.weight.copy_(torch.cat([gate, up]))
        shared.linear_fc2.weight.copy_(down)
        shared.gate_weight.copy_(gw)
        block.shared_expert.gate_proj.weight.copy_(gate)
        block.shared_expert.up_proj.weight.copy_(up)
        block.shared_expert.down_proj.weight.copy_(down)
        block.shared_expert_gate.weight.copy_(gw)
    x = torch.randn(16, 1, h, generator=g, dtype=torch.float64)
    ours = shared(x)
    theirs = torch.sigmoid(block.shared_expert_gate(x[:, 0])) * block.shared_expert(x[:, 0])
    print(json.dumps({"parameters": sorted(n for n, _ in shared.named_parameters()),
                      "rel": float((ours[:, 0] - theirs).abs().max() / theirs.abs().max())}))
"""


@pytest.mark.skipif(absent("torch", "megatron.core", "transformers"), reason="Megatron-Core's SharedExpertMLP")
def test_megatrons_gated_shared_expert_is_hfs_in_float64():
    """Megatron-Core's SharedExpertMLP with the builder's moe_shared_expert_gate, on the weights of HF's shared_expert
    and shared_expert_gate (linear_fc1 = gate and up, gate_weight = shared_expert_gate.weight), computes HF's
    sigmoid(shared_expert_gate(x)) * shared_expert(x) to float64 rounding: the same semantics, not an
    approximation."""
    result = python_json(SHARED, json.dumps(TINY))
    assert result["parameters"] == ["gate_weight", "linear_fc1.weight", "linear_fc2.weight"]
    assert result["rel"] < 1e-14, result


def test_paddles_decoder_layer_reads_no_dense_layers():
    """The dense rule the Paddle room's moe_in_every_layer quirk expresses (every layer MoE when num_experts > 0: no
    mlp_only_layers) is in PaddleFormers 1.2.0's source (the routing lines: tests/test_paddle_families.py)."""
    import importlib.util

    spec = importlib.util.find_spec("paddleformers")
    if spec is None:
        pytest.skip("PaddleFormers (requirements-models.txt) is not installed")
    source = (Path(spec.origin).parent / "transformers" / "qwen2_moe" / "modeling.py").read_text()
    layer = source[source.index("class Qwen2MoeDecoderLayer"):source.index("class Qwen2MoeRotaryEmbedding")]
    assert "if config.num_experts > 0:" in layer and "mlp_only_layers" not in layer


def test_paddle_builds_every_layer_dense_or_none():
    """PaddleFormers reads no mlp_only_layers: every layer dense is num_experts 0 there (the same model); a mix is
    UNSUPPORTED naming the feature and the version."""
    from harness.run.protocol import Unsupported
    from harness.runners.paddle.families import config_kwargs

    assert config_kwargs(Qwen2MoeConfig.resolve(TINY))["num_experts"] == 8
    dense = config_kwargs(Qwen2MoeConfig.resolve({**TINY, "mlp_only_layers": [0, 1]}))
    assert dense["num_experts"] == 0 and dense["intermediate_size"] == 96
    with pytest.raises(Unsupported, match=r"PaddleFormers 1\.2\.0's Qwen2MoeDecoderLayer cannot mix dense and MoE "
                                          r"layers.*mlp_only_layers"):
        config_kwargs(Qwen2MoeConfig.resolve({**TINY, "mlp_only_layers": [0]}))


@pytest.mark.skipif(absent("paddle", "paddleformers"), reason="PaddleFormers' model (requirements-models.txt)")
def test_a_whole_paddle_run_records_its_routing_and_calls_no_stand_in_name(tmp_path):
    """PaddleFormers' Qwen2MoeForCausalLMDeprecated forward and backward (tiny, float32, 8 tokens): the routing of
    both MoE layers is written (each row's top-k ascending, the probabilities not renormalised: each row sums below
    1), the shared expert and its gate's logit captured, the routing record and the paddlefleet stand-in named in
    meta.json, no stand-in name is called and no class comes from it."""
    from tests.support.model_case import model_request

    request = model_request(tmp_path, TINY, "float32", tokens=8)
    result = python_json(f"""
        import json
        from safetensors.numpy import load_file
        from harness.runners.paddle import model as paddle_model, paddlefleet_ops_shim, paddlefleet_shim
        from harness.run.protocol import Phases
        paddlefleet_ops_shim.install()
        request = json.load(open({str(request)!r}))
        meta = paddle_model.run(request, Phases())
        out = load_file(request["output_dir"] + "/outputs.safetensors")
        model = paddle_model.build_model(request["config"]["model"], "float32", request["checkpoint"])[0]
        classes = {{c.__module__ for layer in [model, *model.sublayers()] for c in type(layer).__mro__}}
        routing = {{}}
        for layer in (0, 1):
            p = f"module.model.layers.{{layer}}.mlp."
            idx, probs = out[p + "gate.topk_indices"], out[p + "gate.probs"]
            routing[layer] = {{"ascending": bool((idx[:, 1:] > idx[:, :-1]).all()), "shape": list(idx.shape),
                               "nonzero": int((probs != 0).sum()), "sums": float(probs.sum(1).max()),
                               "gate": list(out[p + "shared_expert_gate"].shape)}}
        print(json.dumps({{"calls": paddlefleet_shim.calls(), "adapters": meta["adapters"], "routing": routing,
                           "from_stand_in": sorted(m for m in classes if m.split(".")[0] == "paddlefleet")}}))
    """)
    assert result["calls"] == [] and result["from_stand_in"] == []
    adapters = {a["name"]: a for a in result["adapters"]}
    assert "paddlefleet stand-in (harness.runners.paddle.paddlefleet_shim)" in adapters
    assert "routing record (harness/runners/paddle/families.py record_routing)" in adapters
    assert all(a["changes_computation"] is False for a in result["adapters"])
    for layer in ("0", "1"):
        routing = result["routing"][layer]
        assert routing["ascending"] and routing["shape"] == [8, 2] and routing["nonzero"] == 16, routing
        assert routing["sums"] < 1 - 1e-3 and routing["gate"] == [8, 1], routing  # top-2 of 8: not renormalised


# --- what its end-to-end runs show (tests/test_model_e2e.py, tests/test_train_zoo_e2e.py: tests/support/zoo.py) ----

# Its float64 cases run by another pair than their own: PaddleFormers' MoE refuses float64, so with both layers dense
FLOAT64_PAIRS = [
    ("qwen2_moe_2layer_float64", ("paddle_model", "hf_model"),
     "PaddleFormers' Qwen2MoeSparseMoeBlock cannot run in float64"),
    ("qwen2_moe_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("qwen2_moe_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
    ("qwen2_moe_2layer_train_float64_dense", ("paddle_model", "hf_model"), None),
]
# One element of layer 0's k_proj bias planted on HF's side, in float64: Megatron's (a part of its fused linear_qkv
# bias) disagrees far beyond the floors there first: ERROR naming k_proj, not a numeric DIFF
PLANTED_FLOAT64 = ("qwen2_moe_2layer_float64", "model.layers.0.self_attn.k_proj.bias", (3,))
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # rows of Megatron's fused linear_qkv

# Gradients bitwise equal at E2E_TOKENS (16), measured on this CPU (AMD EPYC, AVX-512 BF16): (equal, of them of the
# routed experts no token went to: 85 of the 120). bf16 Megatron vs HF parts at the first RMSNorm (also two gradients
# beyond the idle experts': an expert only the last token, whose label is -100, went to); fp32 at layer 0's q/k/v
# (the bias added inside the GEMM or after it), only the idle experts' gradients equal. PaddleFormers vs HF parts at
# the first RMSNorm, and not even the idle experts' gradients are bitwise equal: PaddleFormers runs each idle expert
# on one zero row, and the gradients that leaves are zeros of either sign, HF's +0.0 (as for Qwen3-MoE).
STATED_GRADIENTS = {"qwen2_moe_2layer": (172, 170), "qwen2_moe_2layer_fp32": (170, 170),
                    "qwen2_moe_2layer_fp32_paddle": (0, 0)}
# The training pairs' first divergence on AMD EPYC with AVX-512 BF16 at E2E_TOKENS; elsewhere only its step (1)
TRAIN_FIRST = {"qwen2_moe_2layer_train": "step1.loss", "qwen2_moe_2layer_train_paddle": "step1.grad.lm_head.weight"}


def check_run(case, report, run_dir):
    """The measured gradient counts above; the control (one bit of k_proj.weight[37, 3] on Megatron's side b, which
    Megatron holds in its fused linear_qkv) changes only column 37 of the de-interleaved k_proj output, q_proj and
    v_proj equal; the training pairs' 269 parameters and first tensor; the training float64 check reaches k_proj's
    state and the shared expert's gate."""
    from tests.support.e2e import on_amd_avx512_bf16

    gradients = (report.get("model") or {}).get("gradients")
    if case.name in STATED_GRADIENTS:
        assert gradients["total"] == 269
        assert (gradients["bitwise_pass"], gradients["bitwise_pass_of_idle_experts"]) == STATED_GRADIENTS[
            case.name], gradients
    if case.name == "qwen2_moe_2layer_control_megatron":
        from harness.case.checkpoints import load_tensors

        a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
        b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
        layer = "module.model.layers.0.self_attn."
        assert {int(c) for c in np.nonzero((a[layer + "k_proj"] != b[layer + "k_proj"]).any(axis=0))[0]} == {37}
        for part in ("q_proj", "v_proj"):
            assert np.array_equal(a[layer + part], b[layer + part]), part
    if case.name in TRAIN_FIRST:
        train = report["train"]
        assert train["parameters"] == 269
        if on_amd_avx512_bf16():
            assert train["first_divergence"]["tensor"] == TRAIN_FIRST[case.name], train["first_divergence"]
    if case.op == "causal_lm_train" and case.dtype == "float64":
        names = {t["name"] for t in report["tensors"]}
        assert f"step3.exp_avg.{K_PROJ}" in names
        if case.model.num_experts and not case.model.mlp_only_layers:
            assert "step3.exp_avg.model.layers.1.mlp.shared_expert_gate.weight" in names
