"""GLM-5's DeepSeek Sparse Attention on Megatron-Core (harness/runners/megatron/dsa.py and the rope_rows / detached
entries of harness/families/glm_moe_dsa/names.toml). The CPU venv's megatron-core 0.16.1 has no DSA switches: the
room refuses there; megatron-core >= 0.19 (the GPU machine's 0.19.2, or its pure-Python files on PYTHONPATH here)
builds the local DSA spec, whose tests are skipped under 0.16.1."""

from __future__ import annotations

import pytest

from harness.families import model_config
from tests.support.installed import absent, megatron_has_dsa_switches
from tests.support.tiny_models import TINY

NEEDS_019 = pytest.mark.skipif(not megatron_has_dsa_switches(), reason="megatron-core < 0.19: no DSA switches")


@pytest.mark.skipif(absent("torch", "megatron.core") or megatron_has_dsa_switches(),
                    reason="megatron-core 0.16-0.18 only (0.19 builds the spec)")
def test_megatron_core_without_dsa_switches_refuses_naming_0_19_and_the_hadamard():
    import torch

    from harness.run.protocol import Unsupported
    from harness.runners.megatron import families

    with pytest.raises(Unsupported, match=r"needs megatron-core >= 0.19 .*dsa_indexer_rotate_activation=False.*"
                                          r"fast_hadamard_transform"):
        families.translate_config(model_config(TINY["glm_moe_dsa"]), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(absent("torch"), reason="needs torch")
def test_the_rope_rows_make_megatrons_deinterleave_give_hfs_split_halves():
    """Megatron's MLA rotates x[0::2], x[1::2] of its rope dims; HF rotates x's halves. Loaded through the permutation,
    Megatron's de-interleaved rope dims are HF's, its nope dims untouched; argsort(perm) gives HF's order back."""
    import torch

    from harness.runners.megatron.model import rope_permutation

    m = model_config(TINY["glm_moe_dsa"])
    heads, head, rope, latent = 2, 16, 8, 16  # TINY: 2 heads of 8 nope + 8 rope, kv latent 16
    for rows, blocks, block in (("head", heads, head), ("latent", 1, latent + rope)):
        perm = rope_permutation(m, rows)
        hf = torch.arange(blocks * block)  # each row's own number stands for the row
        megatron = hf[perm].view(blocks, block)
        nope, pe = megatron[:, :block - rope], megatron[:, block - rope:]
        deinterleaved = torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=-1)
        assert torch.equal(torch.cat([nope, deinterleaved], dim=-1).flatten(), hf)
        assert not torch.equal(perm, torch.arange(len(perm)))
        assert torch.equal(megatron.flatten()[torch.argsort(perm)], hf)


@pytest.mark.skipif(absent("torch"), reason="needs torch")
def test_the_selection_drops_megatrons_masked_minus_ones_and_keeps_the_causal_picks():
    import torch

    from harness.runners.megatron.dsa import selected

    indices = torch.tensor([[[0, -1], [1, 0], [2, 0]]])  # query 0 sees one key: Megatron marks the other -1
    assert selected(indices).tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]


def test_the_name_map_loads_the_indexer_without_a_gradient_and_permutes_four_tensors():
    from harness.runners.megatron.model import name_map

    m = model_config(TINY["glm_moe_dsa"])
    names = name_map(m)
    assert set(names["detached"]) == set(m.record.detached(m)) and len(names["detached"]) == 10
    assert {"grad." + n for n in names["parameters"]} == {n for n, _ in m.record.gradients(m)}
    assert sorted(names["rope_rows"]) == sorted(
        f"model.layers.{L}.self_attn.{t}{s}" for L in (0, 1) for t in ("q_b_proj", "kv_a_proj_with_mqa")
        for s in ("", ".weight"))
    assert "model.layers.0.self_attn.kv_b_proj" in names["not_captured"]


@NEEDS_019
def test_the_local_provider_answers_every_backend_call_of_megatrons_dsa_spec_with_a_local_module():
    """Megatron's own DSA layer spec, asked of a backend that names each call, against the harness's: every
    submodule is the local provider's answer to the same call (linear(): Megatron's local Linear), but the two down
    projections, ColumnParallelLinear as in Megatron's local MLA spec."""
    import torch
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from harness.runners.megatron import dsa, families

    config, _ = families.translate_config(model_config(TINY["glm_moe_dsa"]), torch.float32, torch.device("cpu"))
    local = dsa.provider()
    assert local.linear() is Linear

    class Named:  # a test double: each backend call answered by its own name
        def __getattr__(self, method):
            return lambda *args, **kwargs: method

    named = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=Named())[0]
    ours = dsa.block_spec(config, "final").layer_specs[0]
    want = {"linear": Linear, "column_parallel_linear": ColumnParallelLinear,
            "row_parallel_linear": local.row_parallel_linear(), "layer_norm": local.layer_norm(rms_norm=True)}
    attention, mine = named.submodules.self_attention.submodules, ours.submodules.self_attention.submodules
    for field in ("linear_q_up_proj", "linear_kv_up_proj", "linear_proj", "q_layernorm", "kv_layernorm"):
        assert getattr(mine, field) is want[getattr(attention, field)], field
    assert (attention.linear_q_down_proj, attention.linear_kv_down_proj) == ("linear", "linear")
    assert mine.linear_q_down_proj is mine.linear_kv_down_proj is ColumnParallelLinear
    indexer, my_indexer = (a.core_attention.submodules.indexer.submodules for a in (attention, mine))
    for field in ("linear_wq_b", "linear_wk", "linear_weights_proj"):
        assert getattr(indexer, field) == "linear" and getattr(my_indexer, field) is Linear


@NEEDS_019
def test_megatrons_local_linear_equals_its_column_parallel_linear_bit_for_bit():
    """The adapter's linear() against the local module Megatron's MLA spec uses for the same projection: one rank,
    the same weight and input, equal outputs."""
    import torch
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from harness.runners.megatron import families, model

    m = TINY["glm_moe_dsa"]
    device = torch.device("cpu")
    model.init_process_group(device)
    model.install_adapters(device, m)
    config, _ = families.translate_config(model_config(m), torch.float32, device)
    init = torch.nn.init.normal_
    duplicated = Linear(32, 24, config=config, init_method=init, bias=False, parallel_mode="duplicated")
    column = ColumnParallelLinear(32, 24, config=config, init_method=init, bias=False, gather_output=False)
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        duplicated.weight.copy_(weight)
        column.weight.copy_(weight)
    x = torch.randn(16, 1, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(duplicated(x)[0], column(x)[0])


@NEEDS_019
def test_a_dsa_family_without_a_dsa_table_is_refused_naming_it():
    """DeepSeek-V3.2's HF indexer applies a ReLU and its megatron.toml says nothing of its indexer: not mapped."""
    import torch

    from harness.run.protocol import Unsupported
    from harness.runners.megatron import families

    with pytest.raises(Unsupported, match="GLM-5 only: family 'deepseek_v32' has no \\[dsa\\] table"):
        families.translate_config(model_config(TINY["deepseek_v32"]), torch.float32, torch.device("cpu"))
