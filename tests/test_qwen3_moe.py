"""The Qwen3-MoE family (harness/families/qwen3_moe) without running a whole model (bar one tiny Paddle run): its typed
config (Qwen3-30B-A3B's defaults, errors naming key and value), its layout (533 gradients for the 2-layer case), its
name maps (q, k and v interleaved per query group in Megatron's linear_qkv and Paddle's qkv_proj), Megatron Bridge's
settings in the Megatron builder, and the routing: HF's and Megatron's routers on the same logits (the same top-k, not
the same probabilities: by construction), Megatron's routing record (changes nothing), PaddleFormers' routing as the
family records it (by the block's own calls, checked against what each expert was fed). The model runs themselves:
tests/test_model_e2e.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES, family_of
from harness.families.names import NameMap
from tests.support.installed import absent
from tests.support.zoo import assert_config_refused, python_json

Qwen3MoeConfig = FAMILIES["qwen3_moe"].config

TINY = {"family": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128}


@pytest.fixture(scope="module")
def case():
    return Registry.load().get("qwen3_moe_2layer")


# --- the typed config ------------------------------------------------------------------------------------------

def test_defaults_are_qwen3_30b_a3bs_real_values():
    """Qwen/Qwen3-30B-A3B's config (Megatron Bridge's test fixture and Qwen3MoEModelProvider30B_A3B), not HF's class
    defaults (norm_topk_prob False, 24 layers, no head_dim) nor PaddleFormers' (rope_theta 10000)."""
    real = Qwen3MoeConfig.resolve({})
    assert real.to_dict() == {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "attention_bias": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
        "use_sliding_window": False, "family": "qwen3_moe"}
    assert Qwen3MoeConfig.from_dict(real.to_dict()) == real and json.loads(json.dumps(real.to_dict())) == \
        real.to_dict()
    assert real.head_dim != real.hidden_size // real.num_attention_heads
    family = family_of("qwen3_moe")
    assert FAMILIES["qwen3_moe"] is family and family.moe_layers(real) == list(range(48))
    assert family.dense_layers(real) == [] and family.buffers(real) == []


@pytest.mark.parametrize("given, problem", [
    ({"num_expertz": 4}, "unknown key 'num_expertz'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "must be a multiple of num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias must be one of"),
    ({"use_sliding_window": True}, "use_sliding_window must be one of"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings must be one of"),
    ({"norm_topk_prob": 1}, "norm_topk_prob must be bool"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"head_dim": 0}, "head_dim must be > 0"),
    ({"num_experts_per_tok": 9, "num_experts": 8}, "num_experts_per_tok must be <= num_experts"),
    ({"mlp_only_layers": [2], "num_hidden_layers": 2}, "mlp_only_layers must be distinct layers"),
    ({"mlp_only_layers": [0, 0]}, "mlp_only_layers must be distinct layers"),
    ({"mlp_only_layers": 1}, "mlp_only_layers must be a list of int"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be > 0"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "qwen3_moe", Qwen3MoeConfig, given, problem)


# --- the layout ------------------------------------------------------------------------------------------------

def test_the_2layer_case_has_533_gradients_with_q_k_v_apart(case):
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 533 == 1 + 2 * (9 + 128 * 2) + 2
    for layer in (0, 1):
        p = f"grad.model.layers.{layer}."
        assert {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")} <= set(grads)
        assert p + "mlp.gate.weight" in grads and p + "mlp.experts.127.gate_up_proj.weight" in grads
    assert not any(n.endswith(".bias") or "shared_experts" in n for n in grads)  # no bias, no shared expert
    shapes = {s.name: s.shape for s in case.output_specs()}
    assert shapes["module.model.layers.0.self_attn.q_proj"] == (64, 32 * 16)  # 2 x hidden: head_dim != hidden/heads
    assert shapes["module.model.layers.0.self_attn.k_proj"] == (64, 4 * 16)
    assert shapes["module.model.layers.1.self_attn.q_norm"] == (64, 32, 16)  # per head
    assert shapes["module.model.layers.1.self_attn.k_norm"] == (64, 4, 16)
    assert shapes["module.model.layers.1.mlp.gate.probs"] == (64, 128)
    assert shapes["module.model.layers.1.mlp.gate.topk_indices"] == (64, 8)
    assert shapes["grad.model.layers.0.mlp.experts.5.gate_up_proj.weight"] == (2 * 96, 256)
    family = family_of("qwen3_moe")
    assert family.interleave(case.model) == (4, (8 * 16, 16, 16)) and family.buffers(case.model) == []
    assert family.moe_layers(case.model) == [0, 1]


def test_mlp_only_layers_and_the_sparse_step_make_dense_layers_as_hf_reads_them():
    registry = Registry.load()
    dense = registry.get("qwen3_moe_2layer_float64_dense")
    assert not any(".mlp.experts." in s.name or ".mlp.gate." in s.name for s in dense.output_specs())
    grads = {s.name: s.shape for s in dense.output_specs() if s.name.startswith("grad.")}
    assert len(grads) == 1 + 2 * 10 + 2 and grads["grad.model.layers.1.mlp.gate_up_proj.weight"] == (2 * 768, 256)
    family = family_of("qwen3_moe")
    every_other = Qwen3MoeConfig.resolve({**TINY, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                          "mlp_only_layers": [3]})
    assert (family.dense_layers(every_other), family.moe_layers(every_other)) == ([0, 2, 3], [1])


def test_every_case_says_its_pair_and_the_variants_their_dtypes():
    registry = Registry.load()
    cases = {name: registry.get(name) for name in registry.cases if name.startswith("qwen3_moe")}
    assert {n: (c.dtype, c.runners) for n, c in cases.items()} == {
        "qwen3_moe_2layer": ("bfloat16", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_fp32": ("float32", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model")),
        "qwen3_moe_2layer_float64": ("float64", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_float64_dense": ("float64", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "qwen3_moe_2layer_full": ("bfloat16", ("megatron_model", "hf_model")),
        # the training level (cases/qwen3_moe_train.toml)
        "qwen3_moe_2layer_train": ("float32", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_train_bf16": ("bfloat16", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_train_paddle": ("float32", ("megatron_model", "paddle_model")),
        "qwen3_moe_2layer_train_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "qwen3_moe_2layer_train_sgd": ("float32", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_train_float64": ("float64", ("megatron_model", "hf_model")),
        "qwen3_moe_2layer_train_float64_dense": ("float64", ("megatron_model", "paddle_model"))}
    full = cases["qwen3_moe_2layer_full"].model
    assert (full.hidden_size, full.num_attention_heads, full.num_key_value_heads, full.head_dim,
            full.intermediate_size, full.moe_intermediate_size, full.num_experts, full.num_experts_per_tok,
            full.vocab_size) == (2048, 32, 4, 128, 6144, 768, 128, 8, 151936)
    assert cases["qwen3_moe_2layer_full"].devices == ("gpu",)
    small = cases["qwen3_moe_2layer"].model  # the real ratios at reduced widths, every width a multiple of 16
    assert (small.num_attention_heads, small.num_key_value_heads, small.num_experts, small.num_experts_per_tok) == (
        full.num_attention_heads, full.num_key_value_heads, full.num_experts, full.num_experts_per_tok)
    assert small.hidden_size / small.head_dim == full.hidden_size / full.head_dim
    assert small.moe_intermediate_size / small.hidden_size == full.moe_intermediate_size / full.hidden_size
    assert all(w % 16 == 0 for w in (small.hidden_size, small.head_dim, small.moe_intermediate_size,
                                      small.intermediate_size))


# --- the name maps ---------------------------------------------------------------------------------------------

def test_paddle_fuses_q_k_v_per_group_and_transposes_its_router(case):
    paddle = NameMap.load("qwen3_moe", "paddle", model=case.model)
    rule = paddle.rule("checkpoint", "model.layers.1.self_attn.qkv_proj.weight")
    assert rule.kind == "transpose_interleave" and (rule.groups, rule.widths) == (4, (128, 16, 16))
    assert rule.sources == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    rule = paddle.rule("grads", "model.layers.0.self_attn.k_proj.weight")
    assert (rule.kind, rule.sources, rule.index) == ("transpose_deinterleave",
                                                     ("model.layers.0.self_attn.qkv_proj.weight",), 1)
    assert paddle.rule("modules", "model.layers.0.self_attn.v_proj").kind == "deinterleave"
    assert paddle.rule("checkpoint", "model.layers.1.mlp.gate.weight").kind == "transpose"  # [H, E], float32
    assert paddle.rule("grads", "model.layers.1.mlp.gate.weight").kind == "transpose"
    assert paddle.rule("checkpoint", "model.layers.0.mlp.experts.3.up_gate_proj.weight").kind == "cat0_transpose"
    assert "top-k slot, token" in paddle.rule("modules", "model.layers.0.mlp.experts.3").why
    assert paddle.rule("modules", "model.layers.0.self_attn.q_norm").kind == "same"
    assert paddle.float64_floor("grad.model.layers.0.self_attn.k_proj.weight", 1e-10) == 1e-6
    hf = NameMap.load("qwen3_moe", "hf", model=case.model)
    assert hf.rule("checkpoint", "model.layers.1.mlp.experts.gate_up_proj").kind == "stack_cat0"
    assert hf.rule("modules", "model.layers.1.mlp.experts.7").kind == "not_captured"
    assert hf.float64_floor("grad.model.layers.0.self_attn.k_proj.weight", 1e-10) == 1e-10  # nothing below float64


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="Megatron's name map is read by its runner")
def test_megatron_map_has_exactly_the_layouts_tensors():
    """linear_qkv's weight and output are q, k and v interleaved (each a deinterleaved part); q_layernorm and
    k_layernorm exist in every layer; the router's capture is its routing record; no buffer."""
    from harness.runners.megatron.model import name_map

    family = family_of("qwen3_moe")
    for given in (TINY, {**TINY, "mlp_only_layers": [0]}):
        m = Qwen3MoeConfig.resolve(given)
        names = name_map(m)
        assert set(names["parameters"]) == {n[len("grad."):] for n, _ in family.gradients(m)}
        assert names["buffers"] == {}
        routers = {f"model.layers.{L}.mlp.gate" for L in family.moe_layers(m)}
        routing = {f"{r}.{x}" for r in routers for x in ("topk_indices", "probs")}  # both from the router's output
        assert set(names["modules"]) - routers | routing == {
            s.name[len("module."):] for s in family.modules(m, 1) if ".experts." not in s.name}
        assert set(names["not_captured"]) == {s.name[len("module."):] for s in family.modules(m, 1)
                                              if ".experts." in s.name}
    m = Qwen3MoeConfig.resolve(TINY)
    names = name_map(m)
    q = names["parameters"]["model.layers.1.self_attn.q_proj.weight"]
    assert q[0] == "decoder.layers.1.self_attention.linear_qkv.weight" and len(q[1]) == 3
    parts = names["parts"]
    assert {(parts[f"model.layers.0.self_attn.{p}_proj"].index, parts[f"model.layers.0.self_attn.{p}_proj"].sources)
            for p in "qkv"} == {(i, ("decoder.layers.0.self_attention.linear_qkv",)) for i in range(3)}
    assert parts["model.layers.0.self_attn.v_proj.weight"].widths == (4 * 16, 16, 16)
    assert names["modules"]["model.layers.1.self_attn.k_norm"] == "decoder.layers.1.self_attention.k_layernorm"
    assert names["modules"]["model.layers.1.mlp.gate"] == "decoder.layers.1.mlp.router.routing_record"


# --- the routing -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(absent("torch", "megatron.core", "transformers"), reason="both routers")
def test_hf_and_megatron_routers_choose_the_same_experts_and_round_the_probabilities_differently():
    """On the same float32 logits (512 tokens, 128 experts, top-8): HF's Qwen3MoeTopKRouter (softmax over all 128,
    top-8, divided by their sum) and Megatron's router (Bridge's pre_softmax false: top-8 of the logits, softmax over
    those 8) choose the same experts with probabilities equal to float32 rounding, but not bit for bit: by
    construction, whatever the weights. Without the renormalisation (norm_topk_prob false = pre_softmax true) the two
    are bit-equal."""
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Qwen3MoeConfig as HfConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    experts, k = 128, 8
    logits = torch.randn(512, experts, generator=torch.Generator().manual_seed(7)) * 3

    def hf(norm: bool):
        router = Qwen3MoeTopKRouter(HfConfig(hidden_size=experts, num_experts=experts, num_experts_per_tok=k,
                                             norm_topk_prob=norm))
        with torch.no_grad():
            router.weight.copy_(torch.eye(experts))  # F.linear(x, I) is x, exactly
            _, weights, indices = router(logits)
        return torch.zeros_like(logits).scatter(1, indices, weights), indices

    def megatron(pre_softmax: bool):
        return topk_routing_with_score_function(logits, k, use_pre_softmax=pre_softmax, score_function="softmax")

    (hf_probs, hf_indices), (mg_probs, mg_map) = hf(True), megatron(False)
    assert torch.equal(torch.zeros_like(mg_map).scatter(1, hf_indices, True), mg_map)  # the same 8 experts
    rows = int((hf_probs != mg_probs).any(dim=1).sum())
    assert rows > 100, rows  # measured: 501 of 512 rows, 2663 of 4096 probabilities, at most 3.2e-7 (torch 2.13)
    assert float(((hf_probs - mg_probs).abs() / mg_probs.clamp_min(1e-30)).max()) < 1e-6
    (hf_probs, _), (mg_probs, _) = hf(False), megatron(True)
    assert torch.equal(hf_probs, mg_probs)


ROUTER = """
    import json, torch
    from harness.families import model_config
    from harness.runners.megatron.blocks import routing_record_router
    from harness.runners.megatron.families import translate_config
    from harness.runners.megatron import model as mm
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    tiny = json.loads(__import__("sys").argv[1])
    mm.init_process_group(torch.device("cpu"))
    mm.install_adapters(torch.device("cpu"), tiny)
    config, _ = translate_config(model_config(tiny), torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(16, 1, 64, generator=g).to(torch.bfloat16)
    runs = []
    for cls in (TopKRouter, routing_record_router()):
        router = cls(config=config, pg_collection=get_default_pg_collection()).to(torch.bfloat16)
        with torch.no_grad():
            router.weight.copy_(weight)
        seen = {}
        if hasattr(router, "routing_record"):
            router.routing_record.register_forward_hook(lambda m, a, out: seen.update(record=out))
        inp = x.clone().requires_grad_(True)
        probs, routing_map = router(inp)
        (probs * torch.arange(8.0).to(probs.dtype)).sum().backward()
        runs.append((probs, routing_map, inp.grad, router.weight.grad, seen))
    (p0, m0, gx0, gw0, _), (p1, m1, gx1, gw1, seen) = runs
    record = seen["record"]
    print(json.dumps({
        "same_outputs": bool(torch.equal(p0, p1) and torch.equal(m0, m1)),
        "same_gradients": bool(torch.equal(gx0, gx1) and torch.equal(gw0, gw1)),
        "probs_dtype": str(p1.dtype), "record_dtype": str(record[0].dtype),
        "record_exact": bool(torch.equal(record[0], p1.float()) and torch.equal(record[1], m1)),
        "parameters": sorted(n for n, _ in router.named_parameters())}))
"""


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="Megatron-Core's router")
def test_megatron_routing_record_changes_no_computation_and_widens_bf16_probs_exactly():
    """The family's router is Megatron-Core's TopKRouter plus an identity child: in bf16 (Megatron's softmax router
    casts its probabilities to bf16), the same probabilities, routing map and gradients as TopKRouter itself, no
    other parameter, and the child hands the capture the probabilities widened to float32 (exact)."""
    result = python_json(ROUTER, json.dumps(TINY))
    assert result["same_outputs"] and result["same_gradients"], result
    assert (result["probs_dtype"], result["record_dtype"], result["record_exact"]) == (
        "torch.bfloat16", "torch.float32", True)
    assert result["parameters"] == ["weight"]


@pytest.mark.skipif(absent("paddle", "paddleformers"), reason="PaddleFormers' model (requirements-models.txt)")
def test_a_whole_paddle_run_records_its_routing_and_calls_no_stand_in_name(tmp_path):
    """PaddleFormers' Qwen3MoeForCausalLMDeprecated forward and backward (tiny, float32, 8 tokens): the routing of
    both MoE layers is written (each row's top-k ascending, the probabilities renormalised), the routing record and
    the paddlefleet stand-in are named in meta.json, no stand-in name is called and no class comes from it."""
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
            p = f"module.model.layers.{{layer}}.mlp.gate."
            idx, probs = out[p + "topk_indices"], out[p + "probs"]
            routing[layer] = {{"ascending": bool((idx[:, 1:] > idx[:, :-1]).all()), "shape": list(idx.shape),
                               "nonzero": int((probs != 0).sum()), "sums": float(abs(probs.sum(1) - 1).max())}}
        print(json.dumps({{"calls": paddlefleet_shim.calls(), "adapters": meta["adapters"], "routing": routing,
                           "meta_routing": meta["routing"],
                           "from_stand_in": sorted(m for m in classes if m.split(".")[0] == "paddlefleet")}}))
    """)
    assert result["calls"] == [] and result["from_stand_in"] == []
    names = [a["name"] for a in result["adapters"]]
    assert "paddlefleet stand-in (harness.runners.paddle.paddlefleet_shim)" in names
    assert "routing record (harness/runners/paddle/families.py record_routing)" in names
    assert all(a["changes_computation"] is False for a in result["adapters"])
    for layer in ("0", "1"):
        routing = result["routing"][layer]
        assert routing["ascending"] and routing["shape"] == [8, 2] and routing["nonzero"] == 16, routing
        assert routing["sums"] < 1e-6
    assert set(result["meta_routing"]) == {"layer 0", "layer 1"}


SPEC_FORMS = """
    import copy, json
    from functools import partial
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
    from harness.families import family_of
    from harness.runners.megatron.blocks import routing_record_router
    from harness.runners.megatron.families import layer_spec
    forms = {"module_spec": ModuleSpec(module=MoELayer, submodules=MoESubmodules()),
             "partial": partial(MoELayer, submodules=MoESubmodules()), "dense": ModuleSpec(module=object)}
    routers = {}
    for name, mlp in forms.items():
        spec = ModuleSpec(module=object, submodules=TransformerLayerSubmodules(mlp=mlp))
        layer_spec(family_of("qwen3_moe").config(), spec)
        mlp = spec.submodules.mlp
        held = getattr(mlp, "submodules", None) or getattr(mlp, "keywords", {}).get("submodules")
        routers[name] = getattr(held, "router", None) is routing_record_router()
    print(json.dumps(routers))
"""


@pytest.mark.skipif(absent("megatron.core"), reason="Megatron-Core's layer specs")
def test_the_routing_record_goes_into_both_forms_of_megatrons_moe_spec():
    """On the H200 (megatron-core 0.19.2) the MoE layer's spec is ``functools.partial(MoELayer, submodules=...)``,
    not a ModuleSpec (0.16.1 here): the router went unreplaced there and the capture failed naming the missing
    ``routing_record`` (2026-12-03). Both forms now get the family's router; a dense layer keeps its MLP."""
    assert python_json(SPEC_FORMS) == {"module_spec": True, "partial": True, "dense": False}


# --- what its end-to-end runs show (tests/test_model_e2e.py, tests/test_train_zoo_e2e.py: tests/support/zoo.py) ----

# Its float64 cases run by another pair than their own: PaddleFormers' MoE refuses float64, so with both layers dense
FLOAT64_PAIRS = [
    ("qwen3_moe_2layer_float64", ("paddle_model", "hf_model"),
     "PaddleFormers' Qwen3MoeSparseMoeBlock cannot run in float64"),
    ("qwen3_moe_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("qwen3_moe_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
    ("qwen3_moe_2layer_train_float64_dense", ("paddle_model", "hf_model"), None),
]
# One element of layer 0's k_norm weight planted on HF's side, in float64: Megatron's k_norm (its k_layernorm, one
# weight shared by every key head) disagrees far beyond the floors there first: ERROR naming it, not a numeric DIFF
PLANTED_FLOAT64 = ("qwen3_moe_2layer_float64", "model.layers.0.self_attn.k_norm.weight", (3,))
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # rows of Megatron's fused linear_qkv

# Gradients bitwise equal at E2E_TOKENS (16), measured on this CPU (AMD EPYC, AVX-512 BF16): (equal, of them of the
# routed experts no token went to). bf16 Megatron vs HF parts at the first RMSNorm; fp32 at layer 0's router
# probabilities (HF: softmax over all experts, top-k, renormalised; Megatron: top-k of the logits, softmax over k), the
# attention before it bit-equal; only the idle experts' gradients are equal (bf16: also one expert that only the last
# token, whose label is -100, went to). PaddleFormers vs HF parts at the first RMSNorm, and not even the idle experts'
# gradients are bitwise equal: PaddleFormers runs each idle expert on one zero row, and the gradients that leaves are
# zeros of either sign (-0.0 where the upstream gradient is negative), HF's +0.0.
STATED_GRADIENTS = {"qwen3_moe_2layer": (352, 350), "qwen3_moe_2layer_fp32": (350, 350),
                    "qwen3_moe_2layer_fp32_paddle": (0, 0)}
# The training pairs' first divergence on AMD EPYC with AVX-512 BF16 at E2E_TOKENS; elsewhere only its step (1)
TRAIN_FIRST = {"qwen3_moe_2layer_train": "step1.loss", "qwen3_moe_2layer_train_paddle": "step1.loss"}


def check_run(case, report, run_dir):
    """The measured gradient counts above; the control (one bit of k_proj.weight[37, 3] on Megatron's side b, which
    Megatron holds in its fused linear_qkv) changes only column 37 of the de-interleaved k_proj output, and, q/k norms
    being per head, only head 2 of k_norm (dims 32..47 of k), q_proj, v_proj and q_norm equal; the training pairs'
    533 parameters and first tensor, Paddle's idle experts' -0.0; the training float64 check reaches k_proj's state."""
    from tests.support.e2e import on_amd_avx512_bf16

    gradients = (report.get("model") or {}).get("gradients")
    if case.name in STATED_GRADIENTS:
        assert gradients["total"] == 533
        assert (gradients["bitwise_pass"], gradients["bitwise_pass_of_idle_experts"]) == STATED_GRADIENTS[
            case.name], gradients
    if case.name == "qwen3_moe_2layer_control_megatron":
        from harness.case.checkpoints import load_tensors

        a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
        b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
        layer = "module.model.layers.0.self_attn."
        assert {int(c) for c in np.nonzero((a[layer + "k_proj"] != b[layer + "k_proj"]).any(axis=0))[0]} == {37}
        assert {int(h) for h in np.nonzero((a[layer + "k_norm"] != b[layer + "k_norm"]).any(axis=(0, 2)))[0]} == {2}
        for part in ("q_proj", "v_proj", "q_norm"):
            assert np.array_equal(a[layer + part], b[layer + part]), part
    if case.name in TRAIN_FIRST:
        train = report["train"]
        assert train["parameters"] == 533
        if on_amd_avx512_bf16():
            assert train["first_divergence"]["tensor"] == TRAIN_FIRST[case.name], train["first_divergence"]
            if case.name.endswith("_paddle"):  # Paddle's idle experts: -0.0 where Megatron has +0.0
                assert not any(t["status"] == "EQUAL" for t in report["tensors"] if ".grad." in t["name"])
    if case.op == "causal_lm_train" and case.dtype == "float64":
        assert f"step3.exp_avg.{K_PROJ}" in {t["name"] for t in report["tensors"]}
