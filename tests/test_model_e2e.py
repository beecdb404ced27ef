"""The model level end to end on the CPU: real HF transformers DeepseekV3ForCausalLM (hf_model), the 2-layer
Kimi-K2 with 384 experts, 16 tokens (E2E_TOKENS), float32 and float64 only (a CPU without AVX-512 has a slow scalar
bf16 GEMM in torch); and GLM-4.5 MoE (glm4_moe, 128 experts), Qwen3-MoE (qwen3_moe, 128 experts in both layers) and
MiniMax-M2 (minimax_m2, 256 experts), whose cases no baseline records yet: their verdicts are pinned by the
expectations the cases state. Few on purpose: each side imports a model zoo and runs the whole model.

- The negative control: one bit of one routed expert's weight flipped on side b changes exactly that expert's
  output and what follows it, and of the gradients exactly that expert's, those of the experts that share a token
  with it, and everything upstream; the first divergence names the MoE block (HF cannot observe the expert itself).
- The float64 semantic check, parametrized over the pair of runners: every pair must agree to about 1e-10 in
  float64, or be UNSUPPORTED for the one reason known on every platform (PaddleFormers' MoE refuses float64). It
  never skips on CI; elsewhere only where a framework the requirements install is missing, named.
- A planted difference in float64 (a mapping error stand-in) is an ERROR naming the first tensor, never a DIFF.
"""

import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import E2E_TOKENS
from harness import CompareOptions, compare_case
from harness.case.checkpoints import load_tensors
from harness.case.registry import Perturbation, Registry
from tests.support.installed import missing_required, on_ci

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("runner_workers")]

# (case, runners, the UNSUPPORTED reason every platform gives or None): every pair of the three implementations
SEMANTIC_PAIRS = [
    ("kimi_k2_2layer_float64", ("hf_model", "hf_model"), None),
    ("kimi_k2_2layer_float64", ("megatron_model", "hf_model"), None),
    # PaddleFormers' MoE accumulates float64 expert outputs into a float32 buffer, which Paddle refuses
    ("kimi_k2_2layer_float64", ("paddle_model", "hf_model"), "PaddleFormers' DeepseekV3MoE.moe cannot run in float64"),
    ("kimi_k2_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("kimi_k2_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
    ("glm4_moe_2layer_float64", ("megatron_model", "hf_model"), None),
    ("glm4_moe_2layer_float64", ("paddle_model", "hf_model"), "PaddleFormers' Glm4MoeMoE.moe cannot run in float64"),
    ("glm4_moe_2layer_float64_qk_norm", ("megatron_model", "hf_model"), None),
    ("glm4_moe_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("glm4_moe_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
    ("qwen3_moe_2layer_float64", ("megatron_model", "hf_model"), None),
    ("qwen3_moe_2layer_float64", ("paddle_model", "hf_model"),
     "PaddleFormers' Qwen3MoeSparseMoeBlock cannot run in float64"),
    ("qwen3_moe_2layer_float64_dense", ("megatron_model", "hf_model"), None),
    ("qwen3_moe_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("qwen3_moe_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
    ("minimax_m2_2layer_float64", ("megatron_model", "hf_model"), None),
    # PaddleFormers 1.2.0 has no dygraph MiniMax-M2 (only PaddleFleet builders)
    ("minimax_m2_2layer_float64", ("paddle_model", "hf_model"), "MiniMax-M2 has no dygraph model in PaddleFormers"),
]


def _run(name, tmp_path, checkpoints_dir, **kwargs):
    result, run_dir = compare_case(name, CompareOptions(tokens=E2E_TOKENS, checkpoints_dir=checkpoints_dir,
                                                        reports_dir=tmp_path / "reports", **kwargs))
    report = json.loads((run_dir / "report.json").read_text())
    tails = "\n".join(s["stderr_tail"][-2000:] for s in report["sides"] if s["status"] != "ok")
    return result, run_dir, report, tails


def test_negative_control_changes_exactly_the_expert_and_what_depends_on_it(tmp_path, checkpoints_dir):
    result, run_dir, report, tails = _run("kimi_k2_2layer_control_hf", tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, result.expectation, tails)
    expert, layer = 58, 1
    a = load_tensors(run_dir / "a-hf_model" / "outputs.safetensors")
    topk = a[f"module.model.layers.{layer}.mlp.gate.topk_indices"]
    tokens = sorted({int(t) for t in np.nonzero((topk == expert).any(axis=1))[0]})
    assert tokens, "the planted expert must get tokens at this token count"
    sharing = {int(e) for e in topk[tokens].ravel()}  # experts that see a token the planted expert sees
    differing = {t["name"] for t in report["tensors"] if t["status"] != "EQUAL"}
    expected = {f"module.model.layers.{layer}.mlp", f"module.model.layers.{layer}", "module.model.norm", "logits",
                "loss"}
    for spec in Registry.load().get("kimi_k2_2layer_control_hf").with_tokens(E2E_TOKENS).output_specs():
        name = spec.name
        if not name.startswith("grad."):
            continue
        if ".mlp.experts." in name:
            if int(name.split(".mlp.experts.")[1].split(".")[0]) in sharing:
                expected.add(name)
        else:
            expected.add(name)  # upstream of the MoE block, or downstream layers the changed tokens reach
    assert differing == expected, (sorted(differing - expected), sorted(expected - differing))
    # only the rows of the tokens routed to the planted expert change in the logits
    b = load_tensors(run_dir / "b-hf_model" / "outputs.safetensors")
    rows = sorted({int(r) for r in np.nonzero((a["logits"] != b["logits"]).any(axis=1))[0]})
    assert rows == tokens
    assert report["model"]["first_divergence_module"] == f"model.layers.{layer}.mlp"
    assert report["model"]["gradients"]["bitwise_pass"] == 794 - len(expected & {n for n in expected
                                                                               if n.startswith("grad.")})
    markdown = (run_dir / "report.md").read_text()
    assert "canonical gradients BITWISE_PASS" in markdown and "experts.*.gate_up_proj.weight (384 tensors)" in markdown
    assert "module.model.layers.1.mlp.experts.* (384)" in markdown  # not compared: HF fuses its experts


@pytest.mark.parametrize("case, pair, unsupported", SEMANTIC_PAIRS,
                         ids=[f"{c}-{'-vs-'.join(p)}" for c, p, _ in SEMANTIC_PAIRS])
def test_float64_semantic_check(case, pair, unsupported, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, runners=pair, oracle=False)
    if unsupported:
        assert result.verdict == "UNSUPPORTED" and unsupported in result.message, (result.message, tails)
        return
    missing = missing_required(result.message) if result.verdict == "UNSUPPORTED" else None
    if missing and not on_ci():  # only a framework missing here, never on CI (it installs them)
        pytest.skip(f"{missing} is not installed here: {result.message}")
    assert result.verdict != "UNSUPPORTED", f"the semantic check must run: {result.message}\n{tails}"
    semantic = (report.get("model") or {}).get("semantic")
    assert semantic, (result.verdict, result.message, tails)
    assert semantic["ok"], f"mapping error: {semantic['first_mismatch']}: {semantic['tensors_beyond'][:3]}"
    bitwise = all(t["status"] == "EQUAL" for t in report["tensors"])  # a stack against itself; two stacks differ
    assert result.verdict == ("BITWISE_PASS" if bitwise else "WITHIN_TOLERANCE"), result.message
    assert bitwise == (pair[0] == pair[1]), result.message
    # the exit code follows the expectation: another pair than the case's own is held to bitwise (Case.with_runners)
    assert result.exit_code == (0 if pair == ("megatron_model", "hf_model") or result.verdict == "BITWISE_PASS"
                                else 1), result.message
    parameters = load_tensors(run_dir / f"b-{pair[1]}" / "outputs.safetensors")
    assert report["model"]["gradients"]["compared"] == sum(n.startswith("grad.") for n in parameters)
    expected = sum(s.name.startswith("grad.") for s in Registry.load().get(case).with_tokens(E2E_TOKENS).output_specs())
    # Kimi-K2's 2 layers 794, GLM-4.5's 282, Qwen3-MoE's 533, MiniMax-M2's 1045
    assert report["model"]["gradients"]["compared"] == expected


def test_float64_disagreement_is_a_mapping_error_naming_the_first_tensor(tmp_path, checkpoints_dir, monkeypatch):
    registry = Registry.load()
    planted = replace(registry.get("kimi_k2_2layer_float64"), runners=("hf_model", "hf_model"),
                      perturb=Perturbation("b", "model.layers.0.self_attn.kv_b_proj.weight", (5, 3), 50))
    monkeypatch.setattr(Registry, "get", lambda self, name: planted)
    result, run_dir, report, tails = _run("kimi_k2_2layer_float64", tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "ERROR" and "mapping error at module.model.layers.0.self_attn.kv_b_proj" in \
        result.message, (result.message, tails)
    assert report["model"]["semantic"]["first_module"] == "model.layers.0.self_attn.kv_b_proj"


# --- GLM-4.5 MoE (glm4_moe): the cases' stated verdicts on this CPU, the control found at its tensor ----------------

# Each pair's verdict and first divergence, stated by the case (cases/glm4_moe.toml says why each is by construction):
# bf16 Megatron vs HF parts at the first RMSNorm, fp32 at q_proj (HF folds the q/k/v bias into the GEMM, Megatron adds
# it after), PaddleFormers vs HF at the first RMSNorm.
GLM_CASES = ["glm4_moe_2layer", "glm4_moe_2layer_fp32", "glm4_moe_2layer_fp32_paddle"]


@pytest.mark.parametrize("case", GLM_CASES)
def test_glm4_moe_cases_give_their_stated_verdict(case, tmp_path, checkpoints_dir):
    from tests.support.e2e import assert_counts_match_outputs

    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    missing = missing_required(result.message) if result.verdict == "UNSUPPORTED" else None
    if missing and not on_ci():
        pytest.skip(f"{missing} is not installed here: {result.message}")
    assert result.verdict == "DIFF" and result.expectation["met"] and result.exit_code == 0, (
        result.message, result.expectation, tails)
    sides = [load_tensors(run_dir / f"{s['label']}-{s['runner']}" / "outputs.safetensors") for s in report["sides"]
             if s["label"] in ("a", "b")]
    assert_counts_match_outputs(report, *sides)
    stated = Registry.load().get(case)
    assert report["first_divergence"] == stated.expect.differs[0]
    gradients = report["model"]["gradients"]
    assert gradients["total"] == 282 and gradients["bitwise_pass"] >= gradients["bitwise_pass_of_idle_experts"]


def test_glm4_moe_control_is_found_in_its_column_of_the_fused_qkv(tmp_path, checkpoints_dir):
    """One bit of v_proj.bias[5] on Megatron's side b: Megatron holds it as a row of the fused linear_qkv, so only
    column 5 of the de-interleaved v_proj output differs, and the q_proj and k_proj parts of the same fused output
    stay equal: the interleave maps the planted element where it belongs. The first divergence is that module."""
    result, run_dir, report, tails = _run("glm4_moe_2layer_control_megatron", tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, result.expectation, tails)
    a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
    b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
    layer = "module.model.layers.0.self_attn."
    columns = {int(c) for c in np.nonzero((a[layer + "v_proj"] != b[layer + "v_proj"]).any(axis=0))[0]}
    assert columns == {5}
    assert np.array_equal(a[layer + "q_proj"], b[layer + "q_proj"]) and np.array_equal(a[layer + "k_proj"],
                                                                                         b[layer + "k_proj"])
    assert report["model"]["first_divergence_module"] == "model.layers.0.self_attn.v_proj"


def test_glm4_moe_float64_disagreement_is_a_mapping_error_naming_the_fused_part(tmp_path, checkpoints_dir,
                                                                                  monkeypatch):
    """A planted difference in one element of k_proj's bias on HF's side, in float64: Megatron's k_proj (a part of its
    fused linear_qkv) disagrees far beyond the floors there first, so the semantic check says ERROR naming it."""
    registry = Registry.load()
    planted = replace(registry.get("glm4_moe_2layer_float64"),
                      perturb=Perturbation("b", "model.layers.0.self_attn.k_proj.bias", (3,), 50))
    monkeypatch.setattr(Registry, "get", lambda self, name: planted)
    result, run_dir, report, tails = _run("glm4_moe_2layer_float64", tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "ERROR" and "mapping error at module.model.layers.0.self_attn.k_proj" in \
        result.message, (result.message, tails)
    assert report["model"]["semantic"]["first_module"] == "model.layers.0.self_attn.k_proj"


# --- Qwen3-MoE (qwen3_moe): the cases' stated verdicts on this CPU, the control found at its tensor -----------------

# Each pair's verdict, first divergence (stated by the case: cases/qwen3_moe.toml says why each is by construction)
# and gradients bitwise equal at E2E_TOKENS (16), measured on this CPU (AMD EPYC, AVX-512 BF16): (equal, of them of
# the routed experts no token went to). bf16 Megatron vs HF parts at the first RMSNorm; fp32 at layer 0's router
# probabilities (HF: softmax over all experts, top-k, renormalised; Megatron: top-k of the logits, softmax over k), the
# attention before it bit-equal; only the idle experts' gradients are equal (bf16: also one expert that only the last
# token, whose label is -100, went to). PaddleFormers vs HF parts at the first RMSNorm, and not even the idle experts'
# gradients are bitwise equal: PaddleFormers runs each idle expert on one zero row, and the gradients that leaves are
# zeros of either sign (-0.0 where the upstream gradient is negative), HF's +0.0.
QWEN3_CASES = {"qwen3_moe_2layer": (352, 350), "qwen3_moe_2layer_fp32": (350, 350),
               "qwen3_moe_2layer_fp32_paddle": (0, 0)}


@pytest.mark.parametrize("case", QWEN3_CASES)
def test_qwen3_moe_cases_give_their_stated_verdict(case, tmp_path, checkpoints_dir):
    from tests.support.e2e import assert_counts_match_outputs

    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    missing = missing_required(result.message) if result.verdict == "UNSUPPORTED" else None
    if missing and not on_ci():
        pytest.skip(f"{missing} is not installed here: {result.message}")
    assert result.verdict == "DIFF" and result.expectation["met"] and result.exit_code == 0, (
        result.message, result.expectation, tails)
    sides = [load_tensors(run_dir / f"{s['label']}-{s['runner']}" / "outputs.safetensors") for s in report["sides"]
             if s["label"] in ("a", "b")]
    assert_counts_match_outputs(report, *sides)
    stated = Registry.load().get(case)
    assert report["first_divergence"] == stated.expect.differs[0]
    gradients = report["model"]["gradients"]
    assert gradients["total"] == 533
    assert (gradients["bitwise_pass"], gradients["bitwise_pass_of_idle_experts"]) == QWEN3_CASES[case], gradients


def test_qwen3_moe_control_is_found_in_its_column_and_its_head(tmp_path, checkpoints_dir):
    """One bit of k_proj.weight[37, 3] on Megatron's side b: Megatron holds that row in its fused linear_qkv, so only
    column 37 of the de-interleaved k_proj output differs and the q_proj and v_proj parts stay equal; q/k norms are per
    head, so only head 2 of k_norm (dims 32..47 of k) differs and q_norm stays equal. The first divergence is k_proj."""
    result, run_dir, report, tails = _run("qwen3_moe_2layer_control_megatron", tmp_path, checkpoints_dir,
                                          oracle=False)
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, result.expectation, tails)
    a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
    b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
    layer = "module.model.layers.0.self_attn."
    assert {int(c) for c in np.nonzero((a[layer + "k_proj"] != b[layer + "k_proj"]).any(axis=0))[0]} == {37}
    assert {int(h) for h in np.nonzero((a[layer + "k_norm"] != b[layer + "k_norm"]).any(axis=(0, 2)))[0]} == {2}
    for part in ("q_proj", "v_proj", "q_norm"):
        assert np.array_equal(a[layer + part], b[layer + part]), part
    assert report["model"]["first_divergence_module"] == "model.layers.0.self_attn.k_proj"


def test_qwen3_moe_float64_disagreement_is_a_mapping_error_naming_the_per_head_norm(tmp_path, checkpoints_dir,
                                                                                    monkeypatch):
    """A planted difference in one element of layer 0's k_norm weight on HF's side, in float64: Megatron's k_norm
    (its k_layernorm, one weight shared by every key head) disagrees far beyond the floors there first, so the
    semantic check says ERROR naming it, not a numeric DIFF."""
    registry = Registry.load()
    planted = replace(registry.get("qwen3_moe_2layer_float64"),
                      perturb=Perturbation("b", "model.layers.0.self_attn.k_norm.weight", (3,), 50))
    monkeypatch.setattr(Registry, "get", lambda self, name: planted)
    result, run_dir, report, tails = _run("qwen3_moe_2layer_float64", tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "ERROR" and "mapping error at module.model.layers.0.self_attn.k_norm" in \
        result.message, (result.message, tails)
    assert report["model"]["semantic"]["first_module"] == "model.layers.0.self_attn.k_norm"


# --- MiniMax-M2 (minimax_m2): the cases' stated verdicts on this CPU, the control found at its tensor ---------------

# Each pair's verdict and first divergence, stated by the case (cases/minimax_m2.toml says why each is by
# construction): bf16 Megatron vs HF parts at the first RMSNorm, fp32 at layer 0's core attention (baddbmm(alpha=scale)
# against matmul * scale), with everything before it bit-equal, the family's all-heads q/k norm included.
MINIMAX_CASES = ["minimax_m2_2layer", "minimax_m2_2layer_fp32"]


@pytest.mark.parametrize("case", MINIMAX_CASES)
def test_minimax_m2_cases_give_their_stated_verdict(case, tmp_path, checkpoints_dir):
    from tests.support.e2e import assert_counts_match_outputs

    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    missing = missing_required(result.message) if result.verdict == "UNSUPPORTED" else None
    if missing and not on_ci():
        pytest.skip(f"{missing} is not installed here: {result.message}")
    assert result.verdict == "DIFF" and result.expectation["met"] and result.exit_code == 0, (
        result.message, result.expectation, tails)
    sides = [load_tensors(run_dir / f"{s['label']}-{s['runner']}" / "outputs.safetensors") for s in report["sides"]
             if s["label"] in ("a", "b")]
    assert_counts_match_outputs(report, *sides)
    stated = Registry.load().get(case)
    assert report["first_divergence"] == stated.expect.differs[0]
    gradients = report["model"]["gradients"]
    assert gradients["total"] == 1045 and gradients["bitwise_pass"] >= gradients["bitwise_pass_of_idle_experts"]
    adapters = [a["name"] for s in report["sides"] if s["runner"] == "megatron_model" for a in s["meta"]["adapters"]]
    assert "FullDimQKNorm" in adapters  # the family's module, named


def test_minimax_m2_control_is_found_in_its_column_of_the_all_heads_k_norm(tmp_path, checkpoints_dir):
    """One bit of k_norm.weight[5] on Megatron's side b: that weight is the family's own module (k_layernorm.norm, one
    RMSNorm over both key heads), so only column 5 of k_norm's [T, kv_heads x head_dim] output differs, and q, k, v
    and q_norm stay equal: the name map puts the planted element where it belongs. The first divergence is k_norm."""
    result, run_dir, report, tails = _run("minimax_m2_2layer_control_megatron", tmp_path, checkpoints_dir,
                                          oracle=False)
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, result.expectation, tails)
    a = load_tensors(run_dir / "a-megatron_model" / "outputs.safetensors")
    b = load_tensors(run_dir / "b-megatron_model" / "outputs.safetensors")
    layer = "module.model.layers.0.self_attn."
    columns = {int(c) for c in np.nonzero((a[layer + "k_norm"] != b[layer + "k_norm"]).any(axis=0))[0]}
    assert columns == {5}
    for name in ("q_proj", "k_proj", "v_proj", "q_norm"):
        assert np.array_equal(a[layer + name], b[layer + name]), name
    assert report["model"]["first_divergence_module"] == "model.layers.0.self_attn.k_norm"


def test_minimax_m2_float64_disagreement_is_a_mapping_error_naming_the_q_k_norm(tmp_path, checkpoints_dir,
                                                                                monkeypatch):
    """A planted difference in one element of k_norm's weight on HF's side, in float64: Megatron's k_norm (the
    family's all-heads norm) disagrees far beyond the floors there first, so the semantic check says ERROR naming
    it, never a DIFF."""
    registry = Registry.load()
    planted = replace(registry.get("minimax_m2_2layer_float64"),
                      perturb=Perturbation("b", "model.layers.0.self_attn.k_norm.weight", (3,), 50))
    monkeypatch.setattr(Registry, "get", lambda self, name: planted)
    result, run_dir, report, tails = _run("minimax_m2_2layer_float64", tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "ERROR" and "mapping error at module.model.layers.0.self_attn.k_norm" in \
        result.message, (result.message, tails)
    assert report["model"]["semantic"]["first_module"] == "model.layers.0.self_attn.k_norm"
