"""The DeepSeek-V4 family (harness/families/deepseek_v4): its typed config (transformers 5.23.0's DeepseekV4Config
defaults, errors naming key and value), its layout (compressed attention with CSA and HCA compressors and the CSA
indexer, the grouped output projection, hyper-connections, hash-routed and top-k MoE layers; no gradient for the
indexer), its cases, and the facts the layout rests on: transformers 5.23.0's DeepseekV4ForCausalLM gives exactly the
CSA indexer no gradient and folds the legacy keys the family gives as meant. The name map against transformers is the
contract every family passes (tests/test_hf_families.py). docs/model.md "DeepSeek-V4"."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness import environments
from harness.case import generate
from harness.case.registry import CaseError, Registry
from harness.families import FAMILIES
from tests.support.cases import model_case_table
from tests.support.tiny_models import TINY as TINY_MODELS
from tests.support.zoo import assert_config_refused

FAMILY = FAMILIES["deepseek_v4"]
DeepseekV4Config = FAMILY.config
TINY = {k: v for k, v in TINY_MODELS["deepseek_v4"].items() if k != "family"}
ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_deepseek_v4s_values():
    v4 = DeepseekV4Config.resolve({})
    a = FAMILY.architecture(v4)
    assert (a.hidden, a.layers, a.vocab, a.dense_layers, len(a.moe_layers), a.hc_streams) == (
        4096, 43, 129280, (), 43, 4)
    at, c = a.attention, a.attention.compression
    assert (at.kind, at.heads, at.kv_heads, at.head_dim, at.rotary_dim, at.q_lora_rank, at.o_groups,
            at.o_lora_rank) == ("compressed", 64, 1, 512, 64, 1024, 8, 1024)
    assert (c.hca_layers[:3], c.csa_layers[:2], len(c.csa_layers), len(c.hca_layers)) == ((0, 1, 2), (3, 5), 20, 23)
    assert (c.csa_rate, c.hca_rate, c.window) == (4, 128, 128)
    assert (at.indexer.heads, at.indexer.head_dim, at.indexer.topk) == (64, 128, 512)
    assert (a.moe.experts, a.moe.topk, a.moe.shared_ffn, a.moe.topk_scaling, a.moe.scoring) == (
        256, 6, 2048, 1.5, "sqrtsoftplus")
    assert (a.moe.hash_layers, a.moe.swiglu_limit) == ((0, 1, 2), 10.0)
    assert DeepseekV4Config.from_dict(v4.to_dict()) == v4
    none_hashed = DeepseekV4Config.resolve({"num_hash_layers": 0})  # every layer top-k, each with its routing bias
    assert (FAMILY.architecture(none_hashed).moe.hash_layers, len(FAMILY.buffers(none_hashed))) == ((), 43)


@pytest.mark.parametrize("given, problem", [
    ({"num_hidden_layers": 2}, "layer_types must have one entry per layer"),
    ({"num_hidden_layers": 2, "layer_types": ["compressed_sparse_attention", "sliding_attention"]},
     "layer_types entries must be"),
    ({"num_hash_layers": 44}, "num_hash_layers must be in 0..num_hidden_layers"),
    ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim \(7\) must be even"),
    ({"o_groups": 7}, r"o_groups \(7\) must split the heads' width"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "deepseek_v4", DeepseekV4Config, given, problem)


def test_the_2layer_cases_have_116_gradients_and_say_their_pairs():
    registry = Registry.load()
    case = registry.get("deepseek_v4_2layer")
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    # embedding; per layer 2 hyper-connections of 3, 2 norms, the attention's 8, its compressor's 4 (the CSA
    # indexer's 6: none), the router, 16 experts' gate_up and down, the shared expert's 2; hc_head's 3, norm, lm_head
    assert len(grads) == len(set(grads)) == 116 == 1 + 2 * (6 + 2 + 8 + 4 + 1 + 16 * 2 + 2) + 3 + 2
    assert not [g for g in grads if ".indexer." in g] and "grad.model.layers.0.self_attn.compressor.gate_proj." \
        "weight" in grads  # a compressor's gate_proj is no MLP gate: not fused with anything
    selected = [s for s in case.output_specs() if s.name.endswith(".indexer.selected")]
    assert [(s.name, s.shape) for s in selected] == [
        ("module.model.layers.0.self_attn.compressor.indexer.selected", (16, 4))]  # CSA layer 0: 16 // 4 entries
    probs = {s.name: s.dtype for s in case.output_specs() if s.name.endswith(".mlp.gate.probs")}
    assert probs == {f"module.model.layers.{layer}.mlp.gate.probs": None for layer in (0, 1)}  # the model's dtype
    inputs = {s.name: s for s in case.input_specs()}
    table = inputs["model.layers.0.mlp.gate.tid2eid"]  # layer 0 hash-routed, layer 1 top-k with a routing bias
    assert (table.shape, table.dtype, table.role, case.tensors[table.name]) == (
        (2048, 6), "int64", "weight", {"dist": "randint", "high": 16})
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in inputs and not [
        n for n in inputs if n.startswith("model.layers.1.mlp.gate.tid2eid")]
    cases = {name: c for name, c in registry.cases.items() if name.startswith("deepseek_v4_")}
    assert {name: (c.dtype, c.runners, c.expect.verdict) for name, c in cases.items()} == {
        "deepseek_v4_2layer": ("bfloat16", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v4_2layer_fp32": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v4_2layer_fp32_dense_index": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v4_2layer_float64": ("float64", ("hf_model", "hf_model"), "WITHIN_TOLERANCE"),
        "deepseek_v4_2layer_control_hf": ("float32", ("hf_model", "hf_model"), "DIFF"),
        "deepseek_v4_2layer_fp32_megatron": ("float32", ("megatron_model", "hf_model"), "UNSUPPORTED"),
        "deepseek_v4_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model"), "UNSUPPORTED"),
        "deepseek_v4_2layer_train": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v4_2layer_train_float64": ("float64", ("hf_model", "hf_model"), "WITHIN_TOLERANCE"),
        "deepseek_v4_2layer_train_control_hf": ("float32", ("hf_model", "hf_model"), "DIFF"),
        "deepseek_v4_2layer_full": ("bfloat16", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v4_2layer_full_megatron": ("bfloat16", ("megatron_model", "hf_model"), "UNSUPPORTED")}
    dense = cases["deepseek_v4_2layer_fp32_dense_index"].model
    assert dense.index_topk >= case.tokens // dense.compress_rate_csa > case.model.index_topk


def test_the_hash_table_is_drawn_as_expert_ids_and_a_float_draw_is_refused(tmp_path):
    """tid2eid is an int64 weight: drawn whole from [0, experts) by the case's seed; a float distribution, or ids
    past the experts, is refused naming the file, the case and the field."""
    case = Registry.load().get("deepseek_v4_2layer")
    table = generate.draw(generate.plans(case)["model.layers.0.mlp.gate.tid2eid"])
    assert (table.dtype.name, table.shape, int(table.min()), int(table.max())) == ("int64", (2048, 6), 0, 15)
    model = {"family": "deepseek_v4", **TINY}
    for given, problem in (({"dist": "normal", "std": 0.02}, "integer tensors take dist = 'randint'"),
                           ({"dist": "randint", "high": 9}, "0 < high <= 8")):
        tensors = {"model.layers.0.mlp.gate.tid2eid": given}
        (tmp_path / "m.toml").write_text(model_case_table(model, tokens=4, tensors=tensors))
        with pytest.raises(CaseError, match=f"m.toml: case 'm': field 'tensors.model.layers.0.mlp.gate.tid2eid'"
                                            f".*{problem}"):
            Registry.load(tmp_path)


@pytest.mark.slow
def test_hf_gives_exactly_the_csa_indexer_no_gradient_and_folds_the_legacy_keys():
    """Why the layout has no gradient for the CSA indexer: it returns top-k indices only (fp32, 16 tokens, top-2 of 8
    entries), built as the hf room builds it, in the family's environment (transformers 5.23.0: 5.3.0 has no
    deepseek_v4); and DeepseekV4Config folds qk_rope_head_dim, compress_rate_csa / _hca and num_hash_layers as the
    family means them; and the clipped SwiGLU clips some of the cases' pre-activations (cases/deepseek_v4.toml)."""
    code = textwrap.dedent("""
        import json, sys, torch
        from harness.case.registry import Registry
        from harness.families import FAMILIES
        from harness.runners.torch import hf_families
        found = {}
        for name, m in (("tiny", FAMILIES["deepseek_v4"].config.resolve(json.loads(sys.argv[1]))),
                        ("case", Registry.load().get("deepseek_v4_2layer").model)):
            hf = hf_families.modeling(m)
            config = hf_families.hf_config(m, hf)
            torch.manual_seed(0)
            model = getattr(hf, hf_families.model_class(m))(config)
            clipped = []
            def hook(module, args, _out):
                gate_up = torch.nn.functional.linear(args[0], module.gate_up_proj[0])
                clipped.append(float((gate_up.abs() > module.limit).float().mean()))
            for layer in model.model.layers:
                layer.mlp.experts.register_forward_hook(hook)
            ids = torch.randint(0, m.vocab_size, (1, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            found[name] = {"no_grad": sorted(n for n, p in model.named_parameters() if p.grad is None),
                           "config": [config.partial_rotary_factor * config.head_dim, config.compress_rates,
                                      config.mlp_layer_types, config.layer_types],
                           "clipped": clipped}
        print(json.dumps(found))
    """)
    done = subprocess.run([environments.python(environments.of_family(FAMILY)), "-c", code, json.dumps(TINY)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["tiny"]["no_grad"] == sorted(FAMILY.detached(DeepseekV4Config.resolve(TINY))) and len(
        found["tiny"]["no_grad"]) == 6
    assert found["tiny"]["config"] == [8, {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                                       ["hash_moe", "moe"], TINY["layer_types"]]
    assert all(0 < share < 0.5 for share in found["case"]["clipped"]), found["case"]["clipped"]
    assert all(share == 0 for share in found["tiny"]["clipped"])  # the default limit 10 clips none at these widths


# For tests/test_model_e2e.py: a planted float64 difference in the CSA compressor's kv_norm weight (a tensor
# DeepSeek-V4 alone has) must be a mapping error naming module.model.layers.0.self_attn.compressor.kv_norm.
PLANTED_FLOAT64 = ("deepseek_v4_2layer_float64", "model.layers.0.self_attn.compressor.kv_norm.weight", (3,))
