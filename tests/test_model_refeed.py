"""Per-module re-feed at the model level (harness.compare.model_refeed, harness.capture Refeed).

- The attribution on tiny numpy arrays: made by / carried in / equal / not re-fed, the unit a tensor belongs to,
  the first local divergence in forward-then-backward order.
- End to end (real runners, CPU, the 2-layer Kimi-K2 at E2E_TOKENS): the negative control (hf_model vs hf_model,
  one bit of expert 58 flipped on side b) is made by the MoE block holding the expert, and everything downstream
  of it, forward and backward, is carried in; megatron_model vs hf_model in float32: whatever attribution comes
  out, it obeys the structural truths (a tensor made by its module differs in the full run; the first local
  divergence is made).
"""

import json

import numpy as np
import pytest

from conftest import E2E_TOKENS
from harness.capture import GRAD, INPUT, part_of, refeed_units
from harness.case.models import Rule
from harness.case.registry import Registry
from harness.commands.compare import CompareOptions, compare_case
from harness.compare.model_refeed import attribute, owner
from harness.compare.tensors import compare_tensor
from harness.report import blocks, refeed_section
from tests.support.report_text import assert_same_text

UNITS = ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0", "model.layers.1.mlp",
         "model.norm", "lm_head"]

pytestmark = pytest.mark.usefixtures("runner_workers")


@pytest.fixture(scope="module")
def case():
    return Registry.load().get("kimi_k2_2layer_fp32").with_tokens(4)


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((4, 3)).astype(np.float32) for name in
            ("module.model.embed_tokens", INPUT + "model.layers.0.input_layernorm",
             "module.model.layers.0.input_layernorm", "module.model.layers.1.mlp", "module.model.norm", "logits",
             GRAD + "model.norm", "grad.model.norm.weight", "grad.model.layers.1.mlp.experts.3.down_proj.weight",
             "grad.model.layers.0.input_layernorm.weight")}


def test_attribution_tells_made_carried_equal_and_not_refed(case):
    a = _arrays()
    b = {k: v.copy() for k, v in a.items()}
    b["module.model.layers.1.mlp"][0, 0] = np.nextafter(b["module.model.layers.1.mlp"][0, 0], np.float32(9))
    b["grad.model.layers.1.mlp.experts.3.down_proj.weight"][1, 2] *= 2
    del b["logits"]  # written by one run only
    full = {name: compare_tensor(name, a[name], a[name] + (0 if name.startswith("module.model.embed") else 1))
            for name in a}
    report = attribute(case, full, a, b, {"units": UNITS, "not_refed": {"model.layers.{L}.mlp.experts.{E}": "why"}})
    how = report["tensors"]
    assert how["module.model.embed_tokens"] == "equal"
    assert how["module.model.layers.1.mlp"].startswith("made by model.layers.1.mlp")
    assert how["module.model.norm"].startswith("carried in (model.norm")
    assert how["grad.model.layers.1.mlp.experts.3.down_proj.weight"].startswith("made by model.layers.1.mlp")
    assert GRAD + "model.norm" not in how  # not attributed (model_refeed's docstring says why)
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["logits"]["attribution"] == "not re-fed: written only by side a's run"
    assert report["first_local_divergence"] == "module.model.layers.1.mlp"
    assert report["counts"] == {"made": 2, "carried": 5, "equal": 1, "not re-fed": 1}
    names = [r["name"] for r in report["rows"]]  # forward, then backward; a unit's input row before its output
    assert names.index(INPUT + "model.layers.0.input_layernorm") < names.index("module.model.layers.0.input_layernorm")
    assert names.index("logits") < names.index("grad.model.norm.weight") < names.index(
        "grad.model.layers.0.input_layernorm.weight")
    assert owner("grad.model.layers.1.mlp.experts.3.down_proj.weight", UNITS) == "model.layers.1.mlp"
    assert owner(INPUT + "model.layers.0.input_layernorm", UNITS) == "model.layers.0"
    assert owner("logits", UNITS) == "lm_head"
    lines = blocks.markdown(refeed_section.blocks({"refeed": {"kind": "model", "runner": "hf_model",
                                                              "fed_from": "side a (megatron_model)", **report}}, {}))
    page = blocks.html(refeed_section.blocks({"refeed": {"kind": "model", "runner": "hf_model",
                                                         "fed_from": "side a (megatron_model)", **report}}, {}), "t")
    assert_same_text(lines, page)
    assert "made by `model.layers.1.mlp`" in lines


def test_units_come_from_the_name_map_rules():
    rules = {"a": Rule("same", ("x",)), "b": Rule("cat_last", ("g", "u")), "c": Rule("input_of", ("y",)),
             "d": Rule("not_captured", why="fused"), "m.experts.3": Rule("same", ("m.experts.3",))}
    units, why = refeed_units(list(rules), rules.__getitem__, extra={"lm_head": ["lm_head"]},
                              skip={r"\.experts\.\d+$": "routed"})
    assert units == {"a": ["x"], "b": ["g", "u"], "lm_head": ["lm_head"]}
    assert why == {"d": "fused", "m.experts.3": "routed"}
    assert part_of(np.arange(6).reshape(1, 6), 1, 2).tolist() == [[3, 4, 5]]


def _run(name, tmp_path, checkpoints_dir, **kwargs):
    result, run_dir = compare_case(name, CompareOptions(tokens=E2E_TOKENS, checkpoints_dir=checkpoints_dir,
                                                        reports_dir=tmp_path / "reports", oracle=False,
                                                        refeed_ops=True, **kwargs))
    report = json.loads((run_dir / "report.json").read_text())
    assert "error" not in report["refeed"], report["refeed"]
    return report, run_dir


def _structural(refeed: dict) -> None:
    rows = {r["name"]: r for r in refeed["rows"]}
    first = refeed["first_local_divergence"]
    assert first is None or rows[first]["attribution"].startswith("made")
    for r in refeed["rows"]:
        if r["attribution"].startswith("made") and not r["name"].startswith("refeed."):
            assert r["full"] == "DIFF" or r["name"] == first, r
        if r["attribution"].startswith("carried"):
            assert r["full"] == "DIFF" and r["local"] == "EQUAL", r


@pytest.mark.e2e
def test_negative_control_is_made_by_the_moe_block_holding_the_flipped_expert(tmp_path, checkpoints_dir):
    report, run_dir = _run("kimi_k2_2layer_control_hf", tmp_path, checkpoints_dir)
    refeed = report["refeed"]
    _structural(refeed)
    how = refeed["tensors"]
    assert refeed["first_local_divergence"] == "module.model.layers.1.mlp"
    for weight in ("gate_up_proj", "down_proj"):
        assert how[f"grad.model.layers.1.mlp.experts.58.{weight}.weight"].startswith("made by model.layers.1.mlp")
    made = {name for name, h in how.items() if h.startswith("made")}
    # the router's gradient differs too: expert 58's output enters the weighted sum the router's scores scale
    assert made == {"module.model.layers.1.mlp", "grad.model.layers.1.mlp.experts.58.gate_up_proj.weight",
                    "grad.model.layers.1.mlp.experts.58.down_proj.weight", "grad.model.layers.1.mlp.gate.weight"}
    for name in ("module.model.layers.1", "module.model.norm", "logits", "loss", "grad.lm_head.weight",
                 "grad.model.embed_tokens.weight", "grad.model.layers.0.self_attn.q_a_proj.weight"):
        assert how[name].startswith("carried in"), (name, how[name])
    markdown = (run_dir / "report.md").read_text()
    assert "## Re-feed (each module re-run on side b from side a's tensors)" in markdown
    assert "first local divergence (forward, then backward): **`module.model.layers.1.mlp`**" in markdown


@pytest.mark.e2e
def test_megatron_against_hf_float32_obeys_the_structural_truths(tmp_path, checkpoints_dir):
    report, _ = _run("kimi_k2_2layer_fp32", tmp_path, checkpoints_dir, runners=("megatron_model", "hf_model"))
    refeed = report["refeed"]
    _structural(refeed)
    assert refeed["sides"]["record"]["runner"] == "megatron_model" and refeed["runner"] == "hf_model"
    assert {"input", "output", "output gradient"} <= set(refeed["replaced"]["model.layers.0.self_attn.o_proj"])
    differing = [t["name"] for t in report["tensors"] if t["status"] != "EQUAL"]
    if differing:  # a full-run difference is either made somewhere or carried from a not re-fed tensor
        assert refeed["first_local_divergence"] is not None


@pytest.mark.e2e
@pytest.mark.parametrize("runner", ["paddle_model", "megatron_model"])
def test_a_runner_against_itself_replays_bit_exactly(runner, tmp_path, checkpoints_dir):
    """The same code on both sides: replaying side a's tensors (the substitute node, the gradient replacement) must
    give side a's bits everywhere, or the re-feed itself would be making differences."""
    report, _ = _run("kimi_k2_2layer_fp32", tmp_path, checkpoints_dir, runners=(runner, runner))
    refeed = report["refeed"]
    assert refeed["first_local_divergence"] is None, [r for r in refeed["rows"] if r["local"] != "EQUAL"][:5]
    assert refeed["counts"]["made"] == 0 and refeed["counts"]["equal"] > 100
    replaced = refeed["replaced"]
    assert replaced["model.layers.1.mlp"] == ["input", "output", "output gradient"]
    assert replaced["lm_head"] == ["input", "output gradient"]
    assert "model.layers.1.mlp.experts.{E}" in refeed["not_refed"] and len(refeed["not_refed"]) <= 2
