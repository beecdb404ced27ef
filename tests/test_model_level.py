"""The model level without running a model: the causal_lm op record (794 gradients), the resolved config, the name
map, checkpoint generation, the capture API on a small torch module, grouping and the float64 semantic check."""

import math

import numpy as np
import pytest
import torch

from harness.capture.torch import capture
from harness.case.generate import generate
from harness.case.ops import OPS
from harness.case.registry import CaseError, Registry
from harness.compare import model_outputs
from harness.compare.tensors import DIFF, EQUAL, TensorComparison, compare_tensor
from harness.families import FAMILIES, ModelConfigError, family_of, model_config
from harness.families.names import NameMap, expand_stack
from tests.support.cases import model_case_table

DeepseekV3Config = FAMILIES["deepseek_v3"].config


@pytest.fixture(scope="module")
def case():
    return Registry.load().get("kimi_k2_2layer")


def test_kimi_k2_2layer_has_the_seeds_794_gradients_and_384_experts(case):
    outputs = [s.name for s in case.output_specs()]
    grads = [n for n in outputs if n.startswith("grad.")]
    assert len(grads) == len(set(grads)) == 794
    assert sum(".mlp.experts." in n for n in grads) == 768
    assert "grad.model.layers.1.mlp.gate.e_score_correction_bias" not in grads  # a buffer: no gradient
    assert "grad.model.layers.0.mlp.gate_up_proj.weight" in grads and "grad.model.layers.0.mlp.up_proj.weight" \
        not in grads
    experts = [s for s in case.output_specs() if ".mlp.experts." in s.name and s.name.startswith("module.")]
    assert len(experts) == 384 and all(s.optional and s.shape == (-1, 256) for s in experts)


def test_outputs_are_forward_then_backward(case):
    names = [s.name for s in case.output_specs()]
    at = names.index
    assert at("module.model.embed_tokens") < at("module.model.layers.0.self_attn.q_a_proj") < at(
        "module.model.layers.0.self_attn.core_attention") < at("module.model.layers.1.mlp.gate.topk_indices") < at(
        "module.model.layers.1.mlp.experts.0") < at("module.model.layers.1.mlp") < at("module.model.norm") < at(
        "logits") < at("loss") < at("grad.lm_head.weight") < at("grad.model.norm.weight") < at(
        "grad.model.layers.1.mlp.experts.0.down_proj.weight") < at("grad.model.layers.1.mlp.gate.weight") < at(
        "grad.model.layers.0.mlp.down_proj.weight") < at("grad.model.embed_tokens.weight")
    assert names[-1] == "grad.model.embed_tokens.weight"


def test_every_default_is_resolved_to_kimi_k2s_values(case):
    m = case.config["model"]  # the wire form a request and a report carry
    assert list(m) == [*DeepseekV3Config().to_dict()] and m["family"] == "deepseek_v3"
    assert m["rope_scaling"] == {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert (m["rope_theta"], m["routed_scaling_factor"], m["n_group"], m["topk_group"]) == (50000.0, 2.827, 1, 1)
    assert (m["hidden_size"], m["n_routed_experts"], m["num_experts_per_tok"]) == (256, 384, 8)
    full = Registry.load().get("kimi_k2_2layer_full").config["model"]
    assert (full["hidden_size"], full["vocab_size"], full["intermediate_size"]) == (7168, 163840, 18432)


def test_the_typed_config_is_what_code_reads_and_gives_the_wire_dict_back(case):
    m = case.model
    assert isinstance(m, DeepseekV3Config) and m.family == "deepseek_v3"
    assert (m.hidden_size, m.n_routed_experts, m.rope_scaling) == (256, 384, DeepseekV3Config().rope_scaling)
    assert m.to_dict() == case.config["model"] and model_config(case.config["model"]) == m
    assert Registry.load().get("kimi_shared_fc1").model is None  # an op case has no model
    family = family_of(m.family)
    assert FAMILIES["deepseek_v3"] is family and (family.dense_layers(m), family.moe_layers(m)) == ([0], [1])
    assert family.buffers(m) == [("model.layers.1.mlp.gate.e_score_correction_bias", (384,))]
    with pytest.raises(ModelConfigError, match="unknown model family 'glm'"):
        family_of("glm")


def test_variants_have_their_dtypes():
    registry = Registry.load()
    assert [registry.get(f"kimi_k2_2layer{s}").dtype for s in ("", "_fp32", "_float64", "_control_hf")] == [
        "bfloat16", "float32", "float64", "float32"]


@pytest.mark.parametrize("given, problem", [
    ({"hidden_sizee": 4}, "unknown key 'hidden_sizee'"),
    ({"scoring_func": "softmax"}, "scoring_func must be one of"),
    ({"hidden_size": 2.5}, "hidden_size must be int"),
    ({"rope_scaling": {"factorr": 4.0}}, "unknown key 'rope_scaling.factorr'"),
    ({"rope_scaling": {"factor": "4"}}, "rope_scaling.factor must be float"),
])
def test_bad_model_config_is_named(tmp_path, given, problem):
    (tmp_path / "m.toml").write_text(model_case_table(given, tokens=4))
    with pytest.raises(CaseError, match=problem):
        Registry.load(tmp_path)


def test_name_map_rules_for_hf():
    names = NameMap.load("deepseek_v3", "hf")
    rule = names.rule("grads", "model.layers.1.mlp.experts.17.gate_up_proj.weight")
    assert (rule.kind, rule.sources, rule.index) == ("slice", ("model.layers.1.mlp.experts.gate_up_proj",), 17)
    rule = names.rule("grads", "model.layers.0.mlp.gate_up_proj.weight")
    assert rule.kind == "cat0" and rule.sources == ("model.layers.0.mlp.gate_proj.weight",
                                                    "model.layers.0.mlp.up_proj.weight")
    assert names.rule("grads", "lm_head.weight").kind == "same"
    rule = names.rule("checkpoint", "model.layers.1.mlp.experts.gate_up_proj", {"n_routed_experts": 3})
    assert expand_stack(rule)[2] == ["model.layers.1.mlp.experts.2.gate_proj.weight",
                                            "model.layers.1.mlp.experts.2.up_proj.weight"]
    assert names.rule("modules", "model.layers.1.mlp.experts.5").kind == "not_captured"
    assert names.rule("modules", "model.layers.0.self_attn.core_attention").sources == (
        "model.layers.0.self_attn.o_proj",)
    paddle = NameMap.load("deepseek_v3", "paddle")
    assert paddle.rule("grads", "model.layers.1.mlp.experts.3.gate_up_proj.weight").kind == "transpose_cat0"
    assert paddle.float64_floor("grad.lm_head.weight", 1e-10) == 1e-6
    megatron = NameMap.load("deepseek_v3", "megatron")  # its own format: floors only
    assert megatron.own_format and megatron.float64_floor("loss", 1e-10) >= 1e-10
    with pytest.raises(ModelConfigError, match="format of its own"):
        megatron.rule("grads", "lm_head.weight")


def test_checkpoint_holds_hf_names_labels_norms_and_the_fp32_bias(case):
    tensors = generate(case.with_tokens(8))
    assert len(tensors) == len(case.input_specs()) == 1183
    ids, labels = tensors["input_ids"], tensors["labels"]
    assert ids.dtype == labels.dtype == np.int64 and 0 <= ids.min() and ids.max() < 2048
    assert list(labels[:-1]) == list(ids[1:]) and labels[-1] == -100
    norm = tensors["model.layers.0.input_layernorm.weight"].astype(np.float32)
    assert abs(norm.mean() - 1) < 0.01 and norm.std() < 0.05
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert tensors["model.layers.1.mlp.experts.383.down_proj.weight"].shape == (256, 32)
    assert tensors["model.layers.0.self_attn.q_b_proj.weight"].dtype.name == "bfloat16"


class Tiny(torch.nn.Module):
    """A fused 3-D expert parameter, a gate/up pair and an output projection, as HF's DeepSeek-V3 has them."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(2, 4, 3))
        self.o_proj = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        h = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.o_proj(h @ self.experts[1].t())


def test_capture_names_hooks_and_gradient_rules(tmp_path):
    torch.manual_seed(0)
    net = Tiny()
    name_map = NameMap("tiny", "torch", {"grads": {
        "gate_up.weight": {"cat0": ["gate_proj.weight", "up_proj.weight"]},
        "experts.{E}.weight": {"slice": "experts", "index": "{E}"}}, "modules": {
        "fc1": {"cat_last": ["gate_proj", "up_proj"]}, "act": {"input_of": "o_proj"},
        "experts.{E}": {"not_captured": "fused"}}})
    x = torch.randn(1, 5, 4)
    with capture(net, tmp_path / "dump.safetensors", name_map=name_map, modules=["fc1", "act", "o_proj", "experts.0"],
                 grads=["gate_up.weight", "experts.0.weight", "experts.1.weight", "o_proj.weight"]) as cap:
        out = net(x)
        out.sum().backward()
        cap.record("loss", out.sum())
    t = cap.tensors
    assert torch.equal(t["module.fc1"], torch.cat([net.gate_proj(x), net.up_proj(x)], -1)[0].detach())
    assert t["module.act"].shape == (5, 4) and torch.equal(t["module.o_proj"], out[0].detach())
    assert torch.equal(t["grad.gate_up.weight"], torch.cat([net.gate_proj.weight.grad, net.up_proj.weight.grad]))
    assert torch.equal(t["grad.experts.0.weight"], torch.zeros(4, 3))  # unused slice: autograd's zeros
    assert torch.equal(t["grad.experts.1.weight"], net.experts.grad[1])
    assert cap.not_captured == {"module.experts.0": "fused"}
    assert (tmp_path / "dump.safetensors").exists() and not net._forward_hooks and not net.o_proj._forward_pre_hooks


def test_interleave_rows_lay_q_k_v_out_group_by_group():
    """Two groups, q 3 rows a group, k and v 1: rows [q0 q1 q2 k0 v0 | q3 q4 q5 k1 v1] of the parts concatenated
    (q 0..5, k 6..7, v 8..9); each part's rows back out in order."""
    from harness.families.names import interleaved_rows, part_rows

    assert interleaved_rows(2, (3, 1, 1)) == [0, 1, 2, 6, 8, 3, 4, 5, 7, 9]
    assert [part_rows(2, (3, 1, 1), i) for i in range(3)] == [[0, 1, 2, 5, 6, 7], [3, 8], [4, 9]]


def test_interleave_kinds_are_megatrons_qkv_layout_and_invert_exactly():
    """The fused tensor the interleave kind builds is what Megatron's SelfAttention splits (view [groups, (heads /
    groups + 2) x d, ...], split [q, k, v] per group: attention.py get_query_key_value_tensors); de-interleaving
    gives each part back bit for bit, for weights (dim 0), Paddle's transposed weights, biases and module outputs
    (last dim), in torch and in numpy alike."""
    from harness.capture.paddle import apply_rule as numpy_rule
    from harness.capture.torch import apply_rule
    from harness.families.names import Rule

    groups, per_group, d, hidden = 2, 3, 4, 5
    widths = (per_group * d, d, d)
    torch.manual_seed(1)
    q, k, v = (torch.randn(groups * w, hidden) for w in widths)
    fused = apply_rule(Rule("interleave", groups=groups, widths=widths), [q, k, v])
    split = fused.view(groups, (per_group + 2) * d, hidden).split(list(widths), dim=1)
    assert all(torch.equal(part.reshape(-1, hidden), source) for part, source in zip(split, (q, k, v), strict=True))
    for index, source in enumerate((q, k, v)):
        part = Rule("deinterleave", index=index, groups=groups, widths=widths)
        assert torch.equal(apply_rule(part, [fused]), source)
        assert torch.equal(apply_rule(Rule("transpose_deinterleave", index=index, groups=groups, widths=widths),
                                      [fused.t().contiguous()]), source)
        out = torch.randn(7, fused.shape[0])  # a module output [T, fused]: its last dim
        assert torch.equal(apply_rule(part, [out], dim=-1), out[:, part.rows(index)])
        assert np.array_equal(numpy_rule(part, [fused.numpy()]), source.numpy())
    transposed = apply_rule(Rule("transpose_interleave", groups=groups, widths=widths), [q, k, v])
    assert torch.equal(transposed, fused.t()) and np.array_equal(
        numpy_rule(Rule("transpose_interleave", groups=groups, widths=widths), [q.numpy(), k.numpy(), v.numpy()]),
        fused.t().numpy())
    biases = [torch.randn(groups * w) for w in widths]
    fused_bias = apply_rule(Rule("interleave", groups=groups, widths=widths), biases)
    assert torch.equal(fused_bias.view(groups, -1).split(list(widths), dim=1)[1].reshape(-1), biases[1])
    gate, up = torch.randn(3, hidden), torch.randn(3, hidden)
    assert torch.equal(apply_rule(Rule("cat0_transpose"), [gate, up]), torch.cat([gate, up]).t())
    assert np.array_equal(numpy_rule(Rule("cat0_transpose"), [gate.numpy(), up.numpy()]), torch.cat([gate, up]).t())


def _comparison(name, a, b):
    return compare_tensor(name, np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))


def test_semantic_check_names_the_first_tensor_beyond_1e10(case):
    tensors = [_comparison("module.model.embed_tokens", [1.0, 2.0], [1.0, 2.0]),
               _comparison("module.model.layers.0.input_layernorm", [1.0, 2.0], [1.0, 2.0 * (1 + 1e-13)]),
               _comparison("module.model.layers.0.self_attn.q_a_proj", [1.0, 2.0], [1.0, 2.0 * (1 + 1e-6)]),
               _comparison("grad.lm_head.weight", [1.0, 5.0], [1.0, 2.0])]
    check = model_outputs.semantic_check(case, tensors, ("hf_model", "hf_model"))
    assert not check["ok"] and check["first_mismatch"] == "module.model.layers.0.self_attn.q_a_proj"
    assert check["first_module"] == "model.layers.0.self_attn.q_a_proj"
    assert [r["name"] for r in check["tensors_beyond"]] == ["module.model.layers.0.self_attn.q_a_proj",
                                                            "grad.lm_head.weight"]
    assert model_outputs.semantic_check(case, tensors[:2], ("hf_model", "hf_model"))["ok"]
    integers = compare_tensor("module.model.layers.1.mlp.gate.topk_indices", np.array([1, 2]), np.array([1, 3]))
    assert not model_outputs.semantic_check(case, [integers], ("hf_model", "hf_model"))["ok"]


def test_expert_families_fold_into_one_row_each():
    rows = [TensorComparison("grad.lm_head.weight", EQUAL, elements=4).to_dict()]
    for expert in range(384):
        t = TensorComparison(f"grad.model.layers.1.mlp.experts.{expert}.down_proj.weight", EQUAL, elements=10)
        if expert in (7, 9):
            t.status, t.mismatches, t.max_ulp = DIFF, 3, 5 + expert
            t.first_mismatch = {"index": [0, 1], "a_bits": "0x1", "b_bits": "0x2"}
        rows.append(t.to_dict())
    grouped = model_outputs.group_rows(rows)
    assert [r["name"] for r in grouped] == ["grad.lm_head.weight",
                                            "grad.model.layers.1.mlp.experts.*.down_proj.weight (384 tensors)"]
    family = grouped[1]
    assert family["status"] == "DIFF 2/384" and family["mismatches"] == 6 and family["max_ulp"] == 14
    assert family["first_mismatch"]["index"] == "expert 7 [0, 1]"


def test_summary_counts_and_first_divergence_as_a_module_path(case):
    tensors = [TensorComparison(s.name, EQUAL) for s in case.output_specs() if not s.optional]
    by_name = {t.name: t for t in tensors}
    by_name["module.model.layers.1.mlp.shared_experts"].status = DIFF
    by_name["grad.model.layers.1.mlp.experts.3.gate_up_proj.weight"].status = DIFF
    summary = model_outputs.summarise(case, tensors, {"module.model.layers.1.mlp.experts.0": "fused",
                                              "module.model.layers.1.mlp.experts.1": "fused"})
    assert summary["gradients"] == {"total": 794, "bitwise_pass": 793, "compared": 794,
                                    "bitwise_pass_of_idle_experts": 0}
    assert summary["module_outputs"]["bitwise_pass"] == summary["module_outputs"]["compared"] - 1
    assert summary["first_divergence_module"] == "model.layers.1.mlp.shared_experts"
    assert summary["first_gradient_divergence"] == "grad.model.layers.1.mlp.experts.3.gate_up_proj.weight"
    assert summary["not_compared"] == {"module.model.layers.1.mlp.experts.* (2)": "fused"}
    assert OPS["causal_lm"].tp_split_field is None


def test_weights_from_an_hf_checkpoint_are_sliced_to_the_cases_experts(tmp_path):
    from safetensors.numpy import save_file

    from harness.case.checkpoints import CheckpointError, prepare
    case = Registry.load().get("kimi_k2_2layer_fp32").with_tokens(4)
    ours = generate(case)
    theirs = {name: array for name, array in ours.items() if name not in ("input_ids", "labels")}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    theirs["model.layers.1.mlp.gate.weight"] = np.concatenate([theirs["model.layers.1.mlp.gate.weight"]] * 2)
    theirs[bias] = np.concatenate([theirs[bias], np.ones(384, np.float32)])
    theirs["model.layers.1.mlp.experts.384.down_proj.weight"] = np.zeros((256, 32), np.float32)  # beyond the case
    theirs["model.layers.0.mlp.down_proj.weight"] = theirs["model.layers.0.mlp.down_proj.weight"] * 2
    save_file(theirs, str(tmp_path / "model.safetensors"))
    loaded = prepare(case, tmp_path / "ckpt", str(tmp_path / "model.safetensors")).tensors()
    assert np.array_equal(loaded[bias], ours[bias]) and loaded["model.layers.1.mlp.gate.weight"].shape == (384, 256)
    down = "model.layers.0.mlp.down_proj.weight"
    assert np.array_equal(loaded[down], ours[down] * 2)
    del theirs["lm_head.weight"]
    save_file(theirs, str(tmp_path / "partial.safetensors"))
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight'"):
        prepare(case, tmp_path / "ckpt", str(tmp_path / "partial.safetensors"))


def test_float64_yarn_tables_are_hfs_formula():
    """The runner's float64 YaRN inverse frequencies, computed in float32, equal transformers' own (same formula);
    and the config the runner builds gives HF's mscale-squared softmax scale."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from harness.runners.torch.hf_families import hf_config
    from harness.runners.torch.hf_float64 import yarn_inv_freq
    m = Registry.load().get("kimi_k2_2layer").model
    config = hf_config(m, hf)
    theirs = hf.DeepseekV3RotaryEmbedding(config)
    ours, scaling = yarn_inv_freq(config, torch.float32)
    assert torch.equal(ours, theirs.inv_freq) and scaling == theirs.attention_scaling == 1.0
    wide, _ = yarn_inv_freq(config)
    assert wide.dtype == torch.float64 and torch.allclose(wide.float(), ours, rtol=1e-6, atol=0)
    attention = hf.DeepseekV3Attention(config, 0)
    mscale = 0.1 * math.log(32) + 1
    assert attention.scaling == pytest.approx((32 + 16) ** -0.5 * mscale * mscale, rel=1e-15)


def test_semantic_check_takes_signed_zeros_as_agreement_and_reads_floors(case):
    zeros = compare_tensor("grad.model.layers.1.mlp.experts.3.down_proj.weight", np.array([-0.0, 0.0]),
                           np.array([0.0, 0.0]))
    assert zeros.status == DIFF and model_outputs.semantic_check(case, [zeros], ("hf_model", "hf_model"))["ok"]
    rope = _comparison("module.model.layers.0.self_attn.core_attention", [1.0, 2.0], [1.0, 2.0 * (1 + 2e-9)])
    assert not model_outputs.semantic_check(case, [rope], ("hf_model", "hf_model"))["ok"]
    assert model_outputs.semantic_check(case, [rope], ("megatron_model", "hf_model"))["ok"]  # its stated float32 floor
