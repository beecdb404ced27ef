"""The MiniMax-M2 family (harness/families/minimax_m2) without running a whole model: its typed config (MiniMax-M2's
real values as defaults, errors naming key and value), its layout (1045 gradients for the 2-layer case, the all-heads
q/k norm's shapes), its name maps (the checkpoints' Mixtral-style names on disk, q/k/v interleaved in Megatron's
linear_qkv), Megatron Bridge's settings in the Megatron builder, the full-dimension q/k RMSNorm that builder puts in the
local spec (bit for bit transformers' q_norm / k_norm, forward and backward), transformers 5.3.0's rotary_dim trap,
and the Paddle side's UNSUPPORTED. The model runs themselves: tests/test_model_e2e.py."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES, ModelConfigError, family_of
from harness.families.names import NameMap
from harness.run.protocol import Unsupported
from tests.support.installed import absent
from tests.support.zoo import assert_config_refused

MiniMaxM2Config = FAMILIES["minimax_m2"].config

TINY = {"family": "minimax_m2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16, "intermediate_size": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128}


@pytest.fixture(scope="module")
def case():
    return Registry.load().get("minimax_m2_2layer")


# --- the typed config ------------------------------------------------------------------------------------------

def test_defaults_are_minimax_m2s_real_values():
    """MiniMaxAI/MiniMax-M2 (transformers 5.3.0 MiniMaxM2Config's defaults, PaddleFormers 1.2.0's rotary_dim 64 and
    qk-norm keys): 48 heads / 8 kv / head_dim 128, 256 experts top-8, sigmoid with the routing bias, rotary 64 of 128,
    theta 5e6."""
    m2 = MiniMaxM2Config.resolve({})
    assert m2.to_dict() == {
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256,
        "num_experts_per_tok": 8, "rotary_dim": 64, "rope_theta": 5000000.0, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 196608, "tie_word_embeddings": False, "hidden_act": "silu",
        "family": "minimax_m2"}
    assert FAMILIES["minimax_m2"].architecture(m2).attention.rotary_dim / m2.head_dim == 0.5
    assert MiniMaxM2Config.from_dict(m2.to_dict()) == m2
    assert family_of("minimax_m2").dense_layers(m2) == [] and len(family_of("minimax_m2").moe_layers(m2)) == 62


@pytest.mark.parametrize("given, problem", [
    ({"hidden_sizee": 4}, "unknown key 'hidden_sizee'"),
    ({"n_routed_experts": 8}, "unknown key 'n_routed_experts'"),  # PaddleFormers' name; HF's is num_local_experts
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "must be a multiple of num_key_value_heads"),
    ({"rotary_dim": 15}, "rotary_dim must be even"),
    ({"rotary_dim": 256}, "rotary_dim must be even and <= head_dim"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type must be one of"),
    ({"use_qk_norm": False}, "use_qk_norm must be one of"),
    ({"scoring_func": "softmax"}, "scoring_func must be one of"),
    ({"use_routing_bias": False}, "use_routing_bias must be one of"),
    ({"use_qk_norm": 1}, "use_qk_norm must be bool"),
    ({"head_dim": 0}, "head_dim must be > 0"),
    ({"num_experts_per_tok": 9, "num_local_experts": 8}, "num_experts_per_tok must be <= num_local_experts"),
])
def test_a_bad_config_is_refused_naming_key_and_value(tmp_path, given, problem):
    assert_config_refused(tmp_path, "minimax_m2", MiniMaxM2Config, given, problem)


# --- the layout ------------------------------------------------------------------------------------------------

def test_the_2layer_case_has_1045_gradients_and_all_heads_q_k_norms(case):
    grads = {s.name: s.shape for s in case.output_specs() if s.name.startswith("grad.")}
    assert len(grads) == 1045 == 1 + 2 * (9 + 256 * 2) + 2
    for layer in (0, 1):
        p = f"grad.model.layers.{layer}."
        assert grads[p + "self_attn.q_norm.weight"] == (12 * 32,)  # one norm over all 12 heads, not [head_dim]
        assert grads[p + "self_attn.k_norm.weight"] == (2 * 32,)
        assert grads[p + "mlp.gate.weight"] == (256, 192)
        assert grads[p + "mlp.experts.255.gate_up_proj.weight"] == (2 * 96, 192)
        assert not any(n.startswith(p) and n.endswith(".bias") for n in grads)  # no attention bias
        assert not any(n.startswith(p + "mlp.shared_experts") for n in grads)  # no shared expert
    assert "grad.model.layers.1.mlp.e_score_correction_bias" not in grads  # a buffer
    modules = {s.name: s for s in case.output_specs() if s.name.startswith("module.")}
    layer = "module.model.layers.0."
    assert modules[layer + "self_attn.q_norm"].shape == (64, 12 * 32)  # before the head split, as HF computes it
    assert modules[layer + "self_attn.k_norm"].shape == (64, 2 * 32)
    assert modules[layer + "self_attn.core_attention"].shape == (64, 384)  # heads x head_dim = 2 x hidden
    assert modules[layer + "mlp.gate.probs"].shape == (64, 256)
    assert not any(".mlp.gate_up_proj" in n or "shared_experts" in n for n in modules)  # every layer MoE
    family = family_of("minimax_m2")
    assert FAMILIES["minimax_m2"] is family and family.interleave(case.model) == (2, (6 * 32, 32, 32))
    assert family.buffers(case.model) == [(f"model.layers.{L}.mlp.e_score_correction_bias", (256,)) for L in (0, 1)]
    assert case.model.rotary_dim / case.model.head_dim == 0.5  # rotary_dim 16 of head_dim 32, MiniMax-M2's 64 of 128


def test_every_case_says_its_pair_and_the_variants_their_dtypes():
    registry = Registry.load()
    cases = {name: registry.get(name) for name in registry.cases if name.startswith("minimax_m2")}
    assert {n: (c.dtype, c.runners) for n, c in cases.items()} == {
        "minimax_m2_2layer": ("bfloat16", ("megatron_model", "hf_model")),
        "minimax_m2_2layer_fp32": ("float32", ("megatron_model", "hf_model")),
        "minimax_m2_2layer_float64": ("float64", ("megatron_model", "hf_model")),
        "minimax_m2_2layer_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "minimax_m2_2layer_full": ("bfloat16", ("megatron_model", "hf_model")),
        # the training level (cases/minimax_m2_train.toml)
        "minimax_m2_2layer_train": ("float32", ("megatron_model", "hf_model")),
        "minimax_m2_2layer_train_bf16": ("bfloat16", ("megatron_model", "hf_model")),
        "minimax_m2_2layer_train_paddle": ("float32", ("megatron_model", "paddle_model")),
        "minimax_m2_2layer_train_control_megatron": ("float32", ("megatron_model", "megatron_model")),
        "minimax_m2_2layer_train_float64": ("float64", ("megatron_model", "hf_model"))}
    full = cases["minimax_m2_2layer_full"]
    real = MiniMaxM2Config.resolve({})
    assert full.model == MiniMaxM2Config.resolve({**real.to_dict(), "num_hidden_layers": 2})  # real widths
    assert full.devices == ("gpu",) and full.truth is False  # float64: 137 GB of weights and gradients
    reduced = cases["minimax_m2_2layer"].model  # MiniMax-M2's ratios at multiples of 16
    assert reduced.num_attention_heads * reduced.head_dim == 2 * reduced.hidden_size
    assert reduced.num_attention_heads // reduced.num_key_value_heads == 48 // 8
    assert reduced.intermediate_size * 2 == reduced.hidden_size and reduced.rotary_dim * 2 == reduced.head_dim
    assert all(w % 16 == 0 for w in (reduced.hidden_size, reduced.intermediate_size, reduced.head_dim))


# --- the name maps ---------------------------------------------------------------------------------------------

def test_the_checkpoints_mixtral_names_map_to_the_canonical_ones(case):
    """On disk the MoE block is block_sparse_moe with w1 (gate) / w3 (up) / w2 (down), as transformers 5.3.0's
    conversion_mapping ("mixtral" + the minimax_m2 bias renaming) and Megatron Bridge's MiniMaxM2Bridge read them;
    everything else has its canonical name on disk."""
    disk = NameMap.load("minimax_m2", "disk", model=case.model)
    expected = {
        "model.layers.1.mlp.gate.weight": "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.mlp.e_score_correction_bias": "model.layers.1.block_sparse_moe.e_score_correction_bias",
        "model.layers.0.mlp.experts.7.gate_proj.weight": "model.layers.0.block_sparse_moe.experts.7.w1.weight",
        "model.layers.0.mlp.experts.7.up_proj.weight": "model.layers.0.block_sparse_moe.experts.7.w3.weight",
        "model.layers.0.mlp.experts.7.down_proj.weight": "model.layers.0.block_sparse_moe.experts.7.w2.weight",
        "model.layers.0.self_attn.q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
        "model.embed_tokens.weight": "model.embed_tokens.weight"}
    assert {name: disk.rule("checkpoint", name).sources[0] for name in expected} == expected
    names = [name for name, _, _ in family_of("minimax_m2").parameters(case.model)]
    on_disk = [disk.rule("checkpoint", name).sources[0] for name in names]
    assert len(set(on_disk)) == len(names) and not any(".mlp." in n for n in on_disk)


def test_a_checkpoint_in_disk_names_is_imported_by_canonical_name(tmp_path):
    """--weights with a MiniMax-M2 checkpoint as released (Mixtral-style names, a folder of shards with its index):
    every canonical tensor is the on-disk one, the router and its bias sliced to the case's experts."""
    from safetensors.numpy import load_file, save_file

    from harness.case.checkpoints import prepare
    from tests.support.model_case import model_case

    case = model_case(tmp_path, TINY)
    disk = NameMap.load("minimax_m2", "disk", model=case.model)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape, _ in family_of("minimax_m2").parameters(case.model):
        if name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            shape = (8, *shape[1:])  # the released model has more experts than the case: sliced
        tensors[disk.rule("checkpoint", name).sources[0]] = rng.standard_normal(shape).astype(np.float32)
    folder = tmp_path / "released"
    folder.mkdir()
    experts = {k: v for k, v in tensors.items() if "block_sparse_moe" in k}
    save_file({k: v for k, v in tensors.items() if k not in experts}, str(folder / "a.safetensors"))
    save_file(experts, str(folder / "b.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: "b.safetensors" if k in experts else "a.safetensors" for k in tensors}}))
    checkpoint = prepare(case, tmp_path / "checkpoints", weights_file=str(folder))
    made = {}
    for path in checkpoint.files:
        made.update(load_file(str(path)))
    gate = made["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert np.array_equal(gate, tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"])
    assert np.array_equal(made["model.layers.0.mlp.e_score_correction_bias"],
                          tensors["model.layers.0.block_sparse_moe.e_score_correction_bias"][:4])
    assert np.array_equal(made["model.layers.0.self_attn.k_norm.weight"],
                          tensors["model.layers.0.self_attn.k_norm.weight"])
    (folder / "b.safetensors").unlink()
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(Exception, match=r"'model.layers.0.mlp.gate.weight' is "
                                        r"'model.layers.0.block_sparse_moe.gate.weight' on disk"):
        prepare(case, tmp_path / "checkpoints2", weights_file=str(folder))


def test_hf_loads_the_fused_experts_and_has_no_paddle_section(case):
    hf = NameMap.load("minimax_m2", "hf", model=case.model)
    rule = hf.rule("checkpoint", "model.layers.1.mlp.experts.gate_up_proj")
    assert rule.kind == "stack_cat0" and rule.experts == 256
    assert hf.rule("checkpoint", "model.layers.1.mlp.e_score_correction_bias").kind == "same"
    assert hf.rule("modules", "model.layers.0.self_attn.q_norm").kind == "same"  # [b, s, heads x head_dim]
    assert hf.rule("modules", "model.layers.0.mlp.experts.3").kind == "not_captured"
    with pytest.raises(ModelConfigError, match=r"no section \[paddle\]"):
        NameMap.load("minimax_m2", "paddle")
    assert NameMap.load("minimax_m2", "megatron").float64_floor("grad.model.layers.0.self_attn.q_norm.weight",
                                                                1e-10) == 1e-6


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="Megatron's name map is read by its runner")
def test_megatron_map_has_exactly_the_layouts_tensors():
    """Every gradient of the layout and nothing else; q_norm / k_norm are the family module's child norm (its
    weight and its [s, b, heads x head_dim] output); q, k and v are parts of linear_qkv; the bias is the router's."""
    from harness.runners.megatron.model import name_map

    m = MiniMaxM2Config.resolve(TINY)
    names = name_map(m)
    assert set(names["parameters"]) == {n[len("grad."):] for n, _ in family_of("minimax_m2").gradients(m)}
    assert names["parameters"]["model.layers.1.self_attn.q_norm.weight"] == (
        "decoder.layers.1.self_attention.q_layernorm.norm.weight", ["model.layers.1.self_attn.q_norm.weight"])
    assert names["modules"]["model.layers.0.self_attn.k_norm"] == "decoder.layers.0.self_attention.k_layernorm.norm"
    parts = names["parts"]
    assert {(parts[f"model.layers.0.self_attn.{p}_proj"].index, parts[f"model.layers.0.self_attn.{p}_proj"].sources)
            for p in "qkv"} == {(i, ("decoder.layers.0.self_attention.linear_qkv",)) for i in range(3)}
    assert parts["model.layers.0.self_attn.v_proj.weight"].widths == (64, 32, 32)
    assert names["buffers"] == {f"model.layers.{L}.mlp.e_score_correction_bias": (
        f"decoder.layers.{L}.mlp.router.expert_bias", [f"model.layers.{L}.mlp.e_score_correction_bias"])
        for L in (0, 1)}
    assert set(names["not_captured"]) == {f"model.layers.{L}.mlp.experts.{E}" for L in (0, 1) for E in range(4)}


# --- the full-dimension q/k norm on the local spec -------------------------------------------------------------

class _Config:  # what SelfAttention's config gives the spec entry
    def __init__(self, heads, groups, dtype, tp=1):
        self.num_attention_heads, self.num_query_groups = heads, groups
        self.params_dtype, self.tensor_model_parallel_size = dtype, tp


@pytest.mark.skipif(absent("torch", "transformers"), reason="compares with transformers' MiniMaxM2RMSNorm")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads, groups, head_dim", [(12, 2, 32), (48, 8, 128)])  # the case's, MiniMax-M2's
def test_the_full_dim_norm_gives_hfs_q_norm_and_k_norm_bits(dtype, heads, groups, head_dim):
    """FullDimQNorm / FullDimKNorm as SelfAttention calls them ([s, b, heads, head_dim] in and out) against
    transformers' q_norm / k_norm (MiniMaxM2RMSNorm over [b, s, heads x head_dim]) on the same input and weight:
    the output, the input's gradient and the weight's gradient are bit-equal, and the child norm's output is HF's
    [.., heads x head_dim] itself (what the name map captures)."""
    import torch
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    from harness.runners.megatron.blocks import FullDimKNorm, FullDimQNorm

    dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(heads)
    for spec, n in ((FullDimQNorm, heads), (FullDimKNorm, groups)):
        ours = spec(hidden_size=head_dim, config=_Config(heads, groups, dtype), eps=1e-6)
        hf = MiniMaxM2RMSNorm(n * head_dim, eps=1e-6).to(dtype)
        weight = (1 + 0.1 * torch.randn(n * head_dim, generator=generator)).to(dtype)
        with torch.no_grad():
            ours.norm.weight.copy_(weight)
            hf.weight.copy_(weight)
        x = (3 * torch.randn(16, 1, n, head_dim, generator=generator)).to(dtype)  # Megatron's [s, b, heads, d]
        upstream = torch.randn(16, 1, n, head_dim, generator=generator).to(dtype)
        mine, theirs = x.clone().requires_grad_(), x.reshape(1, 16, -1).clone().requires_grad_()  # HF's [b, s, hd]
        seen = {}
        ours.norm.register_forward_hook(lambda m, a, o, seen=seen: seen.setdefault("out", o))
        out_ours, out_hf = ours(mine), hf(theirs)
        assert out_ours.shape == x.shape and seen["out"].shape == (16, 1, n * head_dim)
        assert torch.equal(out_ours.reshape(1, 16, -1), out_hf) and torch.equal(seen["out"].reshape(1, 16, -1), out_hf)
        out_ours.backward(upstream)
        out_hf.backward(upstream.reshape(1, 16, -1))
        assert torch.equal(mine.grad.reshape(1, 16, -1), theirs.grad)
        assert torch.equal(ours.norm.weight.grad, hf.weight.grad)


@pytest.mark.skipif(absent("torch"), reason="the module is torch")
def test_the_full_dim_norm_stays_float64_in_a_float64_run_and_refuses_tp():
    import torch

    from harness.runners.megatron.blocks import FullDimQNorm

    x = torch.randn(4, 1, 3, 8, dtype=torch.float64)
    norm = FullDimQNorm(hidden_size=8, config=_Config(3, 1, torch.float64), eps=1e-6)
    flat = x.reshape(4, 1, 24)
    exact = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm(x).reshape(4, 1, 24), exact, rtol=1e-15, atol=0)  # not through float32
    with pytest.raises(Unsupported, match="tensor-parallel size 1"):
        FullDimQNorm(hidden_size=8, config=_Config(4, 2, torch.float32, tp=2), eps=1e-6)


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="Megatron's build_module")
def test_megatrons_build_module_builds_the_spec_entry():
    """SelfAttention builds q_layernorm through build_module(spec, hidden_size=head_dim, config, eps): a class is
    instantiated (a function would come back unbuilt), sized to all heads."""
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from harness.runners.megatron.blocks import FullDimKNorm, FullDimNorm, FullDimQNorm

    config = _Config(12, 2, torch.float32)
    q = build_module(FullDimQNorm, hidden_size=32, config=config, eps=1e-6)
    k = build_module(FullDimKNorm, hidden_size=32, config=config, eps=1e-6)
    assert isinstance(q, FullDimNorm) and q.norm.weight.shape == (384,) and k.norm.weight.shape == (64,)


# --- HF: transformers 5.3.0 and rotary_dim ---------------------------------------------------------------------

@pytest.mark.skipif(absent("torch", "transformers"), reason="transformers' MiniMaxM2Config")
def test_hf_config_gets_the_partial_rotary_factor_transformers_5_3_ignores():
    """transformers 5.3.0 keeps a checkpoint's rotary_dim as an opaque attribute and rotates every head dim
    (huggingface/transformers#48241): the builder passes partial_rotary_factor itself, and its RoPE table has
    rotary_dim / 2 frequencies."""
    import transformers
    from transformers.models.minimax_m2 import modeling_minimax_m2 as hf

    from harness.runners.torch.hf_families import hf_config

    m = MiniMaxM2Config.resolve(TINY)
    config = hf_config(m, hf)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.rope_parameters["rope_theta"] == 5e6
    assert (config.head_dim, config.num_local_experts, config.router_jitter_noise) == (32, 4, 0.0)
    assert hf.MiniMaxM2RotaryEmbedding(config).inv_freq.shape == (m.rotary_dim // 2,)
    if transformers.__version__ == "5.3.0":  # the trap, as pinned (fixed later by PR #48486)
        ignored = hf.MiniMaxM2Config(rotary_dim=64)
        assert "partial_rotary_factor" not in ignored.rope_parameters
        assert hf.MiniMaxM2RotaryEmbedding(ignored).inv_freq.shape == (64,)  # all 128 dims of each head


# --- the module in a whole Megatron model ------------------------------------------------------------------------

ABLATION = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from harness.runners.megatron import model as mm
    from harness.run.protocol import Phases
    request = json.loads(Path(sys.argv[1]).read_text())
    mm.init_process_group(torch.device("cpu"))
    skip = tuple(sys.argv[2:])
    try:
        outputs, meta, _ = mm.compute(request, Phases(), skip_adapters=skip)
    except Exception as error:
        print(json.dumps({"failed": f"{type(error).__name__}: {str(error)[:300]}"}))
    else:
        print(json.dumps({"adapters": [a["name"] for a in meta["adapters"]],
                          "q_norm": list(outputs["module.model.layers.0.self_attn.q_norm"].shape)}))
""")


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="builds a Megatron GPTModel")
def test_megatron_needs_the_full_dim_norm_and_names_it(tmp_path):
    """A tiny MiniMax-M2 on Megatron (float32, 8 tokens): with the family's module the model builds, loads and runs,
    q_norm comes out [T, heads x head_dim] and meta.json names the adapter; without it the local spec's own per-head
    q_layernorm has no place for the checkpoint's all-heads weight (a failure, never a silent run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.model_case import model_request

    request = model_request(tmp_path, TINY, "float32", tokens=8)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    results = []
    for skip in ([], ["FullDimQKNorm"]):
        done = subprocess.run([sys.executable, "-c", ABLATION, str(request), *skip], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    with_it, without = results
    assert "FullDimQKNorm" in with_it["adapters"] and with_it["q_norm"] == [8, 4 * 32]
    assert "failed" in without and "q_layernorm.weight" in without["failed"], without


# --- what its end-to-end runs show (tests/test_model_e2e.py, tests/test_train_zoo_e2e.py: tests/support/zoo.py) ----

# PaddleFormers 1.2.0 has no dygraph MiniMax-M2 (only PaddleFleet builders)
FLOAT64_PAIRS = [("minimax_m2_2layer_float64", ("paddle_model", "hf_model"),
                  "MiniMax-M2 has no dygraph model in PaddleFormers")]
# One element of k_norm's weight planted on HF's side, in float64: Megatron's k_norm (the family's all-heads norm)
# disagrees far beyond the floors there first, so the semantic check says ERROR naming it, never a DIFF
PLANTED_FLOAT64 = ("minimax_m2_2layer_float64", "model.layers.0.self_attn.k_norm.weight", (3,))
K_NORM = "model.layers.0.self_attn.k_norm.weight"  # the all-heads key norm, Megatron's k_layernorm.norm


def check_run(case, report, run_dir):
    """The stated verdicts (bf16 Megatron vs HF part at the first RMSNorm, fp32 by layer 0's router on every CPU, at
    the core attention already on AMD EPYC: baddbmm(alpha=scale) against matmul * scale; everything before it
    bit-equal, the all-heads q/k norm included)
    have 1045 gradients and name the family's Megatron module. The control, one bit of k_norm.weight[5] on Megatron's
    side b (the family's own module, one RMSNorm over both key heads): only column 5 of k_norm's [T, kv_heads x
    head_dim] output differs, q, k, v and q_norm equal. Training: 1045 parameters, first apart at the loss on AMD EPYC
    with AVX-512 BF16; the float64 check reaches k_norm's state; Paddle's side UNSUPPORTED, naming why."""
    from tests.support.e2e import on_amd_avx512_bf16

    if case.name in ("minimax_m2_2layer", "minimax_m2_2layer_fp32"):
        assert report["model"]["gradients"]["total"] == 1045
        adapters = [a["name"] for s in report["sides"] if s["runner"] == "megatron_model"
                    for a in s["meta"]["adapters"]]
        assert "FullDimQKNorm" in adapters  # the family's module, named
    if case.name == "minimax_m2_2layer_control_megatron":
        from harness.case.checkpoints import load_tensors

        a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
        b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
        layer = "module.model.layers.0.self_attn."
        assert {int(c) for c in np.nonzero((a[layer + "k_norm"] != b[layer + "k_norm"]).any(axis=0))[0]} == {5}
        for name in ("q_proj", "k_proj", "v_proj", "q_norm"):
            assert np.array_equal(a[layer + name], b[layer + name]), name
    if case.name == "minimax_m2_2layer_train":
        train = report["train"]
        assert train["parameters"] == 1045
        if on_amd_avx512_bf16():
            assert train["first_divergence"]["tensor"] == "step1.loss", train["first_divergence"]
    if case.op == "causal_lm_train" and case.dtype == "float64":
        assert f"step3.exp_avg.{K_NORM}" in {t["name"] for t in report["tensors"]}
    if case.name == "minimax_m2_2layer_train_paddle":
        assert "no dygraph model in PaddleFormers" in report["message"], report["message"]
