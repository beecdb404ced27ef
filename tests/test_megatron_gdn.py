"""Qwen3.5-MoE's Gated DeltaNet on Megatron-Core (harness/runners/megatron/gdn.py and the [megatron] section of
harness/families/qwen3_5_moe/names.toml). The CPU venv's megatron-core 0.16.1 and the missing flash-linear-attention
make the room refuse; megatron-core 0.19.2 with fla builds the local GDN spec, whose tests are skipped otherwise.
To run them here: 0.19.2's pure-Python files on PYTHONPATH (as tests/test_megatron_dsa.py says) and fla 0.6.0,
fla-core 0.6.0, einops and triton 3.6.0 (`pip install --no-deps --target DIR`), e.g.
``PYTHONPATH=.:/tmp/mcore019:/tmp/qw-site python -m pytest tests/test_megatron_gdn.py``. On a CPU fla's l2norm (Triton)
cannot run: the equality with HF below replaces it by a test double, so it proves the spec and the name map, never a
verdict (the GPU gives those: docs/examples/zoo/qwen35_megatron_gpu.sh)."""

from __future__ import annotations

import json

import pytest

from harness.families import model_config
from tests.support.installed import absent, megatron_builds_gdn
from tests.support.tiny_models import TINY

NEEDS_GDN = pytest.mark.skipif(not megatron_builds_gdn(), reason="needs megatron-core >= 0.19 and fla")
QWEN = TINY["qwen3_5_moe"]  # layer 0 GDN (2 key / 4 value heads of 16), layer 1 attention (4 heads in 2 groups)


@pytest.mark.skipif(absent("torch", "megatron.core") or megatron_builds_gdn(),
                    reason="megatron-core < 0.19 or no fla only (with both the spec builds)")
def test_without_fla_or_megatron_0_19_the_room_refuses_naming_what_is_missing():
    import torch

    from harness.run.protocol import Unsupported
    from harness.runners.megatron import families

    with pytest.raises(Unsupported, match=r"Gated DeltaNet layers need .*(flash-linear-attention|megatron-core >= "
                                          r"0\.19)"):
        families.translate_config(model_config(QWEN), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(absent("torch"), reason="needs torch")
def test_the_gated_rows_give_megatrons_queries_then_gates_per_group():
    """HF's q_proj: per head its query rows, then its gate rows. Loaded through the permutation and split as Megatron's
    linear_qkv splits a group (its heads' queries, then their gates), each part is HF's; argsort gives HF's order."""
    import torch

    from harness.runners.megatron.gdn import gated_head_rows

    heads, groups, size = 4, 2, 16
    perm = gated_head_rows(model_config(QWEN))
    hf = torch.arange(heads * 2 * size).view(heads, 2, size)  # [head, (query, gate), dim]: each row its number
    megatron = hf.flatten()[perm].view(groups, 2, heads // groups, size)  # [group, (queries, gates), head, dim]
    assert torch.equal(megatron[:, 0].reshape(heads, size), hf[:, 0])
    assert torch.equal(megatron[:, 1].reshape(heads, size), hf[:, 1])
    assert torch.equal(hf.flatten()[perm][torch.argsort(perm)], hf.flatten())


@pytest.mark.skipif(absent("torch"), reason="needs torch")
def test_the_name_map_fuses_in_proj_by_rows_and_takes_each_projection_back():
    """GatedDeltaNet's in_proj is HF's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a concatenated by rows
    (in_proj_split_sections: q, k, v, z, beta, alpha): loading fuses them so, and each canonical tensor (its gradient,
    its module output) is its block back; the zero-centred gammas are marked 1 + w, the gated norm is not."""
    import torch

    from harness.capture.torch import apply_rule
    from harness.runners.megatron.model import name_map

    names = name_map(model_config(QWEN))
    projections = [f"model.layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
    tensors = {n: torch.randn(rows, 64) for n, rows in zip(projections, (128, 64, 4, 4), strict=True)}
    fused = torch.cat([tensors[n] for n in projections])
    for name in projections:
        assert names["parameters"][name] == ("decoder.layers.0.self_attention.in_proj.weight", projections)
        assert torch.equal(apply_rule(names["parts"][name], [fused]), tensors[name])
        module = name.removesuffix(".weight")
        assert torch.equal(apply_rule(names["parts"][module], [fused.T], dim=-1), tensors[name].T)
    assert names["one_plus"] == {"model.norm.weight", "model.layers.1.self_attn.q_norm.weight",
                                 "model.layers.1.self_attn.k_norm.weight"} | {
        f"model.layers.{L}.{n}.weight" for L in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")}
    assert set(names["rope_rows"]) == {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj"}


@NEEDS_GDN
def test_the_local_spec_is_megatrons_gdn_spec_but_in_proj_behind_the_layers_own_norm():
    """Layer 0's self_attention is Megatron's get_gated_delta_net_module_spec on LocalSpecProvider in every submodule
    but in_proj (the provider has no fused norm + linear: None there; ColumnParallelLinear here), and the layer keeps
    the local spec's input norm; layer 1 is Megatron's local GPT layer (SelfAttention)."""
    import torch
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from harness.runners.megatron import families, gdn

    config, _ = families.translate_config(model_config(QWEN), torch.float32, torch.device("cpu"))
    assert config.deterministic_mode and config.attention_output_gate and config.linear_attention_freq == [1, 0]
    megatrons = get_gated_delta_net_module_spec(config, backend=LocalSpecProvider())
    layers = gdn.block_spec(config, "final").layer_specs
    ours = layers[0].submodules.self_attention
    assert ours.module is megatrons.module is GatedDeltaNet
    assert megatrons.submodules.in_proj is None and ours.submodules.in_proj is ColumnParallelLinear
    assert (ours.submodules.out_norm, ours.submodules.out_proj) == (megatrons.submodules.out_norm,
                                                                    megatrons.submodules.out_proj)
    assert layers[0].submodules.input_layernorm is layers[1].submodules.input_layernorm is not IdentityOp
    assert layers[1].submodules.self_attention.module is SelfAttention


@NEEDS_GDN
def test_with_a_torch_l2norm_double_megatron_computes_hfs_model_to_fp32_rounding(tmp_path, monkeypatch):
    """The spec and the name map against transformers' Qwen3_5MoeForCausalLM (its torch paths), fp32, 16 tokens: every
    canonical tensor within 1e-5 relative (measured 2026-12-06: at most 6.6e-7), where a wrong row, gate order or
    gamma is O(1). A TEST DOUBLE stands in for fla's l2norm (Triton, no CPU backend): HF's own torch formula
    x * rsqrt(sum(x^2) + 1e-6), monkeypatched into GatedDeltaNet's module for this test only; never a verdict."""
    import torch
    from megatron.core.ssm.gated_delta_net import common
    from safetensors.torch import load_file

    from harness.run.protocol import OUTPUTS, Phases
    from harness.runners.megatron import model as megatron_model
    from harness.runners.torch import hf_model
    from tests.support.hf_reference import relative_error
    from tests.support.model_case import model_request

    request = json.loads(model_request(tmp_path, QWEN, "float32", 16).read_text())
    (tmp_path / "out").mkdir()
    hf_model.run(dict(request), Phases())
    hf = load_file(str(tmp_path / "out" / OUTPUTS))
    monkeypatch.setattr(common, "l2norm", lambda x, dim=-1, eps=1e-6: x * torch.rsqrt((x * x).sum(
        dim=dim, keepdim=True) + eps))
    megatron_model.init_process_group(torch.device("cpu"))
    ours, meta, _ = megatron_model.compute(request, Phases())
    assert set(hf) - set(ours) == {f"module.model.layers.{L}.mlp.shared_expert_gate" for L in (0, 1)}
    assert set(ours) <= set(hf)
    assert "local_gated_delta_net_spec" in [a["name"] for a in meta["adapters"]]
    worst = max((relative_error(ours[n].double(), hf[n].double()), n) for n in ours)
    assert worst[0] < 1e-5, worst


@NEEDS_GDN
def test_a_training_run_reads_every_parameter_back_in_hfs_names_rows_and_gammas(tmp_path):
    """MegatronStates (the training level's read-back) on the loaded model, before any step: every canonical parameter
    is the checkpoint's tensor (q_proj's rows back in HF's per-head query, gate order; in_proj's blocks), but the 7
    zero-centred gammas, held as 1 + w and read as gamma - 1: w to gamma's precision (2^-24 at 1). The optimizer is a
    TEST DOUBLE with no inner optimizers: a parameter's value is read from the model, which is all this test reads."""
    from types import SimpleNamespace

    import torch

    from harness.runners.megatron import model as megatron_model
    from harness.runners.megatron.train import MegatronStates
    from harness.runners.torch import env as torch_env
    from tests.support.model_case import model_request

    request = json.loads(model_request(tmp_path, QWEN, "float32", 16).read_text())
    device = torch.device("cpu")
    megatron_model.init_process_group(device)
    megatron_model.install_adapters(device, QWEN)
    config, _ = megatron_model.translate_config(QWEN, torch.float32, device)
    model = megatron_model.build_model(config, QWEN, device)
    names = megatron_model.name_map(QWEN)
    checkpoint = torch_env.load_inputs(request["checkpoint"], device)
    megatron_model.load_weights(model, names, checkpoint)
    params, _ = MegatronStates(names, model, SimpleNamespace(chained_optimizers=[])).held("param")
    assert set(params) == set(names["parameters"])
    gammas = {name for name in params if name in names["one_plus"]}
    assert len(gammas) == 7
    for name, value in params.items():  # gate_up: its two checkpoint tensors, as HF fuses them
        expected = checkpoint.get(name)
        expected = torch.cat([checkpoint[s] for s in names["parameters"][name][1]]) if expected is None else expected
        if name in gammas:
            assert 0 < (value - expected).abs().max() <= 2.0 ** -24, name
        else:
            assert torch.equal(value, expected), name
