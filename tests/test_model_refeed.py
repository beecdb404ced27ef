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
from harness import CompareOptions, compare_case
from harness.capture import GRAD, INPUT, input_key, part_of, refeed_units
from harness.case.registry import Registry
from harness.compare.model_refeed import attribute, owner
from harness.compare.tensors import compare_tensor
from harness.families.names import Rule
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
    everything = {unit: ["input", "output", "output gradient"] for unit in UNITS}
    report = attribute(case, full, a, b, {"units": UNITS, "replaced": everything,
                                          "not_refed": {"model.layers.{L}.mlp.experts.{E}": "why"}})
    how = report["tensors"]
    assert how["module.model.embed_tokens"] == "equal"
    assert how["module.model.layers.1.mlp"].startswith("made by model.layers.1.mlp")
    assert how["module.model.norm"].startswith("carried in (model.norm")
    assert how["grad.model.layers.1.mlp.experts.3.down_proj.weight"].startswith("made by model.layers.1.mlp")
    assert GRAD + "model.norm" not in how  # not attributed (model_refeed's docstring says why)
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["logits"]["attribution"] == "not re-fed: written only by side a's run"
    assert report["first_local_divergence"] == "module.model.layers.1.mlp"
    # issue 29, finding 9: the module inputs the replay fed are rows of their own, not the case's tensors (the summary
    # called 853 rows "tensors" where 827 were compared)
    assert report["counts"] == {"made": 2, "carried": 4, "equal": 1, "not re-fed": 1}
    assert report["input_counts"] == {"made": 0, "carried": 1, "equal": 0, "not re-fed": 0}
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
    assert "of the case's 8 output tensors and gradients: 2 made by their module, 4 carried in" in lines
    assert "and the 1 module inputs the replay fed (rows of their own, not outputs)" in lines


def test_a_unit_with_nothing_replaced_is_not_refed_and_never_counted(case):
    """Side b's run replaced nothing of model.norm (side a recorded nothing for it): the unit is not re-fed, its
    output is "not re-fed: why" (no re-fed unit holds it), never "made by" it. The old attribution counted every
    unit the runner listed."""
    a = _arrays()
    b = {k: v.copy() for k, v in a.items()}
    b["module.model.norm"][0, 0] += 1
    full = {name: compare_tensor(name, a[name], b[name]) for name in a}
    replaced = {unit: ["input", "output", "output gradient"] for unit in UNITS if unit != "model.norm"}
    report = attribute(case, full, a, b, {"units": UNITS, "replaced": replaced, "not_refed": {}})
    assert "model.norm" not in report["units"] and len(report["units"]) == len(UNITS) - 1
    assert report["not_refed"]["model.norm"] == "side b's run replaced nothing of it"
    assert report["tensors"].get("module.model.norm") is None
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["module.model.norm"]["attribution"] == "not re-fed: side b's run replaced nothing of it"
    assert report["first_local_divergence"] is None
    # a reason from side b's run (capture's RefeedBook) is kept as it said it
    said = "nothing of it was replaced (input: side a recorded no input for it)"
    report = attribute(case, full, a, b, {"units": UNITS, "replaced": replaced, "not_refed": {"model.norm": said}})
    assert {r["name"]: r for r in report["rows"]}["module.model.norm"]["attribution"] == f"not re-fed: {said}"


def test_core_attention_rows_are_its_query_key_and_value(case):
    """A unit taking several tensor arguments (Megatron's core attention) gets one input row per argument, before
    its output, each attributed to the code feeding it."""
    unit = "model.layers.0.self_attn.core_attention"
    rng = np.random.default_rng(1)
    a = {input_key(unit, arg): rng.standard_normal((4, 2, 3)).astype(np.float32) for arg in ("query", "key", "value")}
    a["module." + unit] = rng.standard_normal((4, 6)).astype(np.float32)
    b = {k: v.copy() for k, v in a.items()}
    b[input_key(unit, "key")][1, 0, 2] *= 2  # a RoPE difference: made before core attention, not by it
    full = {"module." + unit: compare_tensor("x", a["module." + unit], a["module." + unit] + 1)}
    meta = {"units": ["model.layers.0", unit], "arguments": {unit: ["query", "key", "value"]},
            "replaced": {"model.layers.0": ["input"], unit: ["query", "key", "value", "output", "output gradient"]},
            "not_refed": {}}
    report = attribute(case, full, a, b, meta)
    names = [r["name"] for r in report["rows"]]
    assert names[:4] == ["refeed.query." + unit, "refeed.key." + unit, "refeed.value." + unit, "module." + unit]
    assert report["first_local_divergence"] == "refeed.key." + unit
    assert report["first_local_unit"] == f"the code feeding {unit} (key) (inside model.layers.0)"
    assert report["tensors"]["module." + unit].startswith("carried in")


def _attention_block(torch, shift: float):
    """Test double: a block whose "RoPE" scales the key by 1 + `shift` before its core attention (query, key, value
    as three positional arguments, as Megatron's MLA calls its core attention)."""
    class CoreAttention(torch.nn.Module):
        def forward(self, query, key, value, mask=None):
            return torch.softmax(query @ key.transpose(-1, -2), dim=-1) @ value

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4, bias=False)
            self.core_attention = CoreAttention()
            with torch.no_grad():
                self.proj.weight.copy_(torch.arange(16.0).view(4, 4) / 16)

        def forward(self, x):
            h = self.proj(x)
            return self.core_attention(h * 2, h * (1 + shift), h * 3, None)

    return Block()


def _step(torch, model, refeed):
    x = torch.linspace(-1, 1, 12).view(1, 3, 4)
    local = {}
    handle = model.core_attention.register_forward_hook(lambda m, a, o: local.__setitem__("out", o.detach().clone()))
    from harness.capture.torch import Refeed
    hooks = Refeed(model, {"proj": ["proj"], "core_attention": ["core_attention"]}, refeed["mode"],
                   refeed.get("from"), arguments={"core_attention": ("query", "key", "value")})
    model(x).sum().backward()
    tensors = hooks.finish()
    handle.remove()
    return tensors, hooks, local["out"]


def test_core_attention_replay_replaces_query_key_and_value(tmp_path):
    """Side b's key differs before core attention (its "RoPE"); replayed with side a's query, key and value, side
    b's core attention computes side a's bits, so the difference is not blamed on it. The old re-feed replaced the
    query only and core attention's output differed."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    recorded, _, a_out = _step(torch, _attention_block(torch, 0.0), {"mode": "record"})
    save_file(recorded, str(tmp_path / "a.safetensors"))
    assert {"refeed.query.core_attention", "refeed.key.core_attention", "refeed.value.core_attention"} <= set(recorded)
    replayed, hooks, b_out = _step(torch, _attention_block(torch, 0.5), {"mode": "replay",
                                                                        "from": tmp_path / "a.safetensors"})
    assert torch.equal(b_out, a_out)
    assert hooks.replaced["core_attention"] == ["query", "key", "value", "output", "output gradient"]
    assert not torch.equal(replayed["refeed.key.core_attention"], recorded["refeed.key.core_attention"])
    assert torch.equal(replayed["refeed.query.core_attention"], recorded["refeed.query.core_attention"])
    assert hooks.not_refed == {} and hooks.meta()["arguments"] == {"core_attention": ["query", "key", "value"]}


@pytest.mark.parametrize("dropped, said", [
    ("refeed.", "nothing of it was replaced (query: side a recorded no query for it; key: side a recorded no key "
                "for it; value: side a recorded no value for it; output: side a recorded no output for it; output "
                "gradient: side a recorded no output gradient for it)"),
    ("refeed.grad_output.", "not all of it was replaced (output gradient: side a recorded no output gradient for "
                            "it)"),
])
def test_a_unit_side_a_recorded_nothing_or_part_of_is_not_refed(tmp_path, dropped, said):
    """Side a's file lacks the unit's tensors (all, or its output gradient): side b's run says the unit is not
    re-fed and why. The old Refeed listed it among the re-fed units."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    recorded, _, _ = _step(torch, _attention_block(torch, 0.0), {"mode": "record"})
    kept = {k: v for k, v in recorded.items() if not (k.startswith(dropped) and k.endswith(".core_attention"))}
    save_file(kept, str(tmp_path / "a.safetensors"))
    _, hooks, _ = _step(torch, _attention_block(torch, 0.0), {"mode": "replay", "from": tmp_path / "a.safetensors"})
    assert hooks.not_refed == {"core_attention": said}
    assert "proj" not in hooks.not_refed


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


@pytest.mark.slow  # a model pair and its re-feed: 41 s on 2 shared cores (the first tier's longest, 2026-12-06)
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
# Paddle's replay is the second tier's (18 s on 2 shared cores, 2026-12-06); Megatron's stays here.
@pytest.mark.parametrize("runner", [pytest.param("paddle_model", marks=pytest.mark.slow), "megatron_model"])
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
    if runner == "megatron_model":  # MLA's core attention takes query, key and value: all three replaced
        assert replaced["model.layers.0.self_attn.core_attention"] == ["query", "key", "value", "output",
                                                                         "output gradient"]
