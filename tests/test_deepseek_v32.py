"""The DeepSeek-V3.2 family (harness/families/deepseek_v32): its typed config (DeepSeek-V3.2's defaults, errors naming
key and value), its layout (GLM-5's DSA indexer on DeepSeek-V3's MLA with YaRN, no gradient for the indexer), its
cases, and the fact the layout rests on: transformers 5.23.0's DeepseekV32ForCausalLM gives the indexer no gradient.
The name map against transformers is the contract every family passes (tests/test_hf_families.py). docs/model.md
"DeepSeek-V3.2"."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness import environments
from harness.case.registry import Registry
from harness.families import FAMILIES
from tests.support.tiny_models import TINY as TINY_MODELS
from tests.support.zoo import assert_config_refused

FAMILY = FAMILIES["deepseek_v32"]
DeepseekV32Config = FAMILY.config
TINY = {k: v for k, v in TINY_MODELS["deepseek_v32"].items() if k != "family"}
ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_deepseek_v32s_values():
    v32 = DeepseekV32Config.resolve({})
    a = FAMILY.architecture(v32)
    assert (a.hidden, a.layers, a.vocab, a.dense_layers, len(a.moe_layers)) == (7168, 61, 129280, (0, 1, 2), 58)
    at = a.attention
    assert (at.kind, at.heads, at.head_dim, at.v_head_dim, at.rotary_dim, at.q_lora_rank, at.kv_lora_rank) == (
        "mla", 128, 128 + 64, 128, 64, 1536, 512)
    assert (at.indexer.heads, at.indexer.head_dim, at.indexer.topk) == (64, 128, 2048)
    assert (a.moe.experts, a.moe.topk, a.moe.shared_ffn, a.moe.topk_scaling) == (256, 8, 2048, 2.5)
    assert (v32.n_group, v32.topk_group, v32.rope_scaling.type, v32.rope_scaling.factor) == (8, 4, "yarn", 40.0)
    assert DeepseekV32Config.from_dict(v32.to_dict()) == v32


@pytest.mark.parametrize("given, problem", [
    ({"n_routed_experts": 12}, r"n_group \(8\) must split n_routed_experts"),
    ({"n_routed_experts": 16, "num_experts_per_tok": 9}, "must be <= the experts of topk_group groups"),
    ({"index_head_dim": 32}, "must hold the rotated qk_rope_head_dim"),
    ({"num_hidden_layers": 2}, "first_k_dense_replace must be in 0..num_hidden_layers"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "deepseek_v32", DeepseekV32Config, given, problem)


def test_the_2layer_cases_have_90_gradients_and_say_their_pairs():
    registry = Registry.load()
    case = registry.get("deepseek_v32_2layer")
    grads = [s.name for s in case.output_specs() if s.name.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 90 == 1 + 11 + 12 + 32 * 2 + 2
    assert sum(s.name.endswith(".indexer.selected") for s in case.output_specs()) == 2
    assert (case.model.n_group, case.model.topk_group) == (8, 4)  # the routing is group-limited, as the model's
    cases = {name: c for name, c in registry.cases.items() if name.startswith("deepseek_v32_")}
    assert {name: (c.dtype, c.runners, c.expect.verdict) for name, c in cases.items()} == {
        "deepseek_v32_2layer": ("bfloat16", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v32_2layer_fp32": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v32_2layer_fp32_dense_index": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v32_2layer_float64": ("float64", ("hf_model", "hf_model"), "WITHIN_TOLERANCE"),
        "deepseek_v32_2layer_control_hf": ("float32", ("hf_model", "hf_model"), "DIFF"),
        "deepseek_v32_2layer_fp32_megatron": ("float32", ("megatron_model", "hf_model"), "UNSUPPORTED"),
        "deepseek_v32_2layer_fp32_paddle": ("float32", ("paddle_model", "hf_model"), "UNSUPPORTED"),
        "deepseek_v32_2layer_train": ("float32", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v32_2layer_train_float64": ("float64", ("hf_model", "hf_model"), "WITHIN_TOLERANCE"),
        "deepseek_v32_2layer_train_control_hf": ("float32", ("hf_model", "hf_model"), "DIFF"),
        "deepseek_v32_2layer_full": ("bfloat16", ("hf_model", "hf_model"), "BITWISE_PASS"),
        "deepseek_v32_2layer_full_megatron": ("bfloat16", ("megatron_model", "hf_model"), "UNSUPPORTED")}
    assert cases["deepseek_v32_2layer_fp32_dense_index"].model.index_topk >= case.tokens > case.model.index_topk


@pytest.mark.slow
def test_hf_gives_the_indexer_no_gradient_and_every_other_parameter_one():
    """Why the layout has no gradient for the indexer: transformers runs it under no_grad (fp32, 8 tokens, top-3),
    built as the hf room builds it, in the family's environment (transformers 5.23.0: 5.3.0 has no deepseek_v32)."""
    code = textwrap.dedent("""
        import json, sys, torch
        from harness.families import FAMILIES
        from harness.runners.torch import hf_families
        m = FAMILIES["deepseek_v32"].config.resolve(json.loads(sys.argv[1]))
        hf = hf_families.modeling(m)
        torch.manual_seed(0)
        model = getattr(hf, hf_families.model_class(m))(hf_families.hf_config(m, hf))
        ids = torch.randint(0, 64, (1, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        print(json.dumps(sorted(n for n, p in model.named_parameters() if p.grad is None)))
    """)
    done = subprocess.run([environments.python(environments.of_family(FAMILY)), "-c", code, json.dumps(TINY)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == sorted(FAMILY.detached(DeepseekV32Config.resolve(TINY)))


# For tests/test_model_e2e.py: a planted float64 difference in the indexer's LayerNorm bias (a tensor the DSA
# families alone have) must be a mapping error naming module.model.layers.0.self_attn.indexer.k_norm.
PLANTED_FLOAT64 = ("deepseek_v32_2layer_float64", "model.layers.0.self_attn.indexer.k_norm.bias", (3,))
