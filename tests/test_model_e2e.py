"""The model level end to end on the CPU: real HF transformers DeepseekV3ForCausalLM (hf_model), the 2-layer
Kimi-K2 with 384 experts, 16 tokens (E2E_TOKENS), float32 and float64 only (a CPU without AVX-512 has a slow scalar
bf16 GEMM in torch); and every other family of the zoo (harness/families/): their verdicts are pinned by the
expectations the cases state (what holds on every CPU), each case found in the registry (tests/support/zoo.py), so a
new family's cases run here without an edit, and where this platform's baseline records a case, by its record. Few on
purpose: each side imports a model zoo and runs the whole model.

- The negative control: one bit of one routed expert's weight flipped on side b changes exactly that expert's
  output and what follows it, and of the gradients exactly that expert's, those of the experts that share a token
  with it, and everything upstream; the first divergence names the MoE block (HF cannot observe the expert itself).
- The float64 semantic check, parametrized over the pair of runners: every pair must agree to about 1e-10 in
  float64, or be UNSUPPORTED for the one reason known on every platform (PaddleFormers' MoE refuses float64). It
  never skips on CI; elsewhere only where a framework the requirements install is missing, named.
- A planted difference in float64 (a mapping error stand-in) is an ERROR naming the first tensor, never a DIFF.
- The zoo's cases give the verdict they state and repeat this platform's record of them (where the first difference
  falls is the CPU's: an Intel Xeon with AMX gives the same bits where AMD's kernels part), their controls are found
  at their tensors, and a difference planted in each family's float64 case is a mapping error naming it.
"""

import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import E2E_TOKENS
from harness import CompareOptions, compare_case
from harness.case.checkpoints import load_tensors
from harness.case.registry import Perturbation, Registry
from harness.families import family_of
from tests.support import zoo
from tests.support.installed import missing_required, on_ci

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("runner_workers")]

# (case, runners, the UNSUPPORTED reason every platform gives or None): every pair of the three implementations;
# the zoo's: each float64 case's own pair and the others its family's tests add (tests/support/zoo.py)
SEMANTIC_PAIRS = [
    ("kimi_k2_2layer_float64", ("hf_model", "hf_model"), None),
    ("kimi_k2_2layer_float64", ("megatron_model", "hf_model"), None),
    # PaddleFormers' MoE accumulates float64 expert outputs into a float32 buffer, which Paddle refuses
    ("kimi_k2_2layer_float64", ("paddle_model", "hf_model"), "PaddleFormers' DeepseekV3MoE.moe cannot run in float64"),
    ("kimi_k2_2layer_float64_dense", ("paddle_model", "hf_model"), None),
    ("kimi_k2_2layer_float64_dense", ("megatron_model", "paddle_model"), None),
    *zoo.float64_pairs(zoo.zoo_cases("causal_lm")),
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
    # Kimi-K2's 2 layers 794; the zoo's: as the family's test file counts them
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


# --- The zoo (every family but DeepSeek-V3): its cases' stated verdicts on this CPU, its controls, a planted error ---

# Each pair's verdict and the tensors that differ on every CPU are stated by the case (cases/<family>.toml says why
# each is by construction); the first divergence and every other tensor are the platform's baseline record's; what a
# family measured beyond them its tests/test_<family>.py checks (tests/support/zoo.py).
STATED = [case.name for case in zoo.zoo_cases("causal_lm")
          if case.perturb is None and case.dtype != "float64" and case.runners[0] != case.runners[1]]
CONTROLS = [case.name for case in zoo.zoo_cases("causal_lm") if case.perturb is not None]


@pytest.mark.parametrize("case", STATED)
def test_zoo_cases_give_their_stated_verdict(case, tmp_path, checkpoints_dir):
    from tests.support.e2e import assert_counts_match_outputs, assert_repeats_the_record, committed_record

    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    missing = missing_required(result.message) if result.verdict == "UNSUPPORTED" else None
    if missing and not on_ci():
        pytest.skip(f"{missing} is not installed here: {result.message}")
    stated = Registry.load().get(case)
    assert result.verdict == stated.expect.verdict and result.expectation["met"] and result.exit_code == 0, (
        result.message, result.expectation, tails)
    if result.verdict == "UNSUPPORTED":  # a pair the case says cannot run here (GLM-5 on Megatron-Core, Paddle)
        return
    sides = [load_tensors(run_dir / f"{s['label']}-{s['runner']}" / "outputs.safetensors") for s in report["sides"]
             if s["label"] in ("a", "b")]
    assert_counts_match_outputs(report, *sides)
    known, table = committed_record(stated)
    if known is not None:  # where the first difference falls is the CPU's (cases/glm4_moe.toml): its record pins it
        assert_repeats_the_record(stated, report, table)
    gradients = report["model"]["gradients"]  # as many as the family's layout has (its test file pins the count)
    assert gradients["total"] == len(family_of(stated.model.family).gradients(stated.model))
    assert gradients["bitwise_pass"] >= gradients["bitwise_pass_of_idle_experts"]
    zoo.check_run(stated, report, run_dir)


@pytest.mark.parametrize("case", CONTROLS)
def test_zoo_control_is_found_at_its_tensor(case, tmp_path, checkpoints_dir):
    """One bit planted on side b of a stack against itself (the case's `perturb`): DIFF as the case states, the first
    divergence the first module it says differs; the family's tests check the column it differs in."""
    result, run_dir, report, tails = _run(case, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, result.expectation, tails)
    stated = Registry.load().get(case)
    assert "module." + report["model"]["first_divergence_module"] == stated.expect.differs[0]
    zoo.check_run(stated, report, run_dir)


@pytest.mark.parametrize("family", zoo.ZOO)
def test_zoo_float64_disagreement_is_a_mapping_error_naming_the_tensor(family, tmp_path, checkpoints_dir,
                                                                      monkeypatch):
    """A planted difference in one element of a parameter on HF's side, in float64 (the family's PLANTED_FLOAT64: a
    part of a fused tensor, a q/k norm): the other stack disagrees far beyond the floors there first, so the semantic
    check says ERROR naming that module, never a numeric DIFF."""
    name, tensor, index = zoo.family_tests(family).PLANTED_FLOAT64
    planted = replace(Registry.load().get(name), perturb=Perturbation("b", tensor, index, 50))
    monkeypatch.setattr(Registry, "get", lambda self, name: planted)
    result, run_dir, report, tails = _run(name, tmp_path, checkpoints_dir, oracle=False)
    module = tensor.rsplit(".", 1)[0]  # the weight's or bias's module
    assert result.verdict == "ERROR" and f"mapping error at module.{module}" in result.message, (result.message, tails)
    assert report["model"]["semantic"]["first_module"] == module
