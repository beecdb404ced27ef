"""Module capture at chosen steps of a recorded torch loop (issue 42, item 2): ``StepRecorder(..., modules_at=[2])``
writes step 2's module outputs of each micro-batch in canonical names (``harness.attach.modules``: the model level's
``Capture``), and ``compare-runs`` names the first divergent module at the first divergent step
(``harness.compare.module_steps``). The loop is tests/support/torch_loop.py's (docs/attach.md, "Any torch loop": HF's
tiny DeepSeek-V3, float32, CPU, 2 AdamW steps of 2 micro-batches).

- Recording module outputs changes nothing: every parameter and optimizer state tensor at the end equals the run
  recorded without them, bit for bit; so when the recording stops at step 2 (a test double of the step writer fills
  the disk), and then no module file is written for it.
- One ULP planted in ``model.layers.0.self_attn.q_a_proj``'s output at its third forward (step 2, micro-batch 0): the
  first divergent module is that one, at step 2, micro-batch 0, every module output before it equal; DIFF, exit 1,
  whether or not the step's state shows it (on the Intel Xeon with AMX, 2026-12-06, it does not: the step files are
  bitwise equal and only 3 module outputs differ, that one and the two after it).
- One ULP planted in the gradient reaching ``model.layers.1.self_attn.o_proj``'s output at step 2, micro-batch 1: the
  first divergent is that module's output gradient there.
- With a float64 truth run of the same loop that captured step 2, a planted +1.0 there: the truth sides with run A.
- A run against itself: the module outputs equal; a step captured by one run only is a note.
"""

import json
import shutil

import pytest

from harness.commands.compare_runs import compare_runs
from tests.support.torch_loop import assert_same_bits, disk_full_at_step_2, final_bits, train

MODULE = "model.layers.0.self_attn.q_a_proj"
GRAD_MODULE = "model.layers.1.self_attn.o_proj"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("modules-at")
    folders = {}
    for name, options in {"a": {}, "b": {"plant": (MODULE, 3, None)}, "big": {"plant": (MODULE, 3, 1.0)},
                          "grad": {"plant_grad": (GRAD_MODULE, 4)},
                          "truth": {"float64": True}}.items():
        folders[name], model, optimizer = train(root / name, modules_at=[2], **options)
        if name == "a":
            folders["a_bits"] = final_bits(model, optimizer)
    return folders


def report(run_dir):
    return json.loads((run_dir / "report.json").read_text())


def test_recording_module_outputs_changes_nothing(runs, tmp_path):
    _, model, optimizer = train(tmp_path / "plain")
    assert_same_bits(final_bits(model, optimizer), runs["a_bits"])


def test_a_recording_that_stops_captures_no_more_modules_and_changes_nothing(runs, tmp_path):
    folder, model, optimizer = train(tmp_path / "stopped", modules_at=[1, 2], writer=disk_full_at_step_2)
    assert sorted(p.name for p in (folder / "modules").iterdir()) == ["step00001.safetensors"]
    assert json.loads((folder / "meta.json").read_text())["capture"]["stopped"]["step"] == 2
    assert_same_bits(final_bits(model, optimizer), runs["a_bits"])


def test_a_planted_bit_is_located_at_its_module_and_step(runs, tmp_path):
    result, run_dir = compare_runs(runs["a"], runs["b"], reports_dir=tmp_path)
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    data = report(run_dir)
    assert data["train"]["steps"][0]["verdict"] == "BITWISE_PASS"  # step 2 may absorb the ULP
    first = data["train"]["modules"]["first_divergence"]
    assert first == {"step": 2, "module": MODULE, "quantity": "output", "micro_batch": 0,
                     "tensor": f"step2.module.mb0.module.{MODULE}", "truth": None}
    assert f"first divergent module: {MODULE} (output) at step 2, micro-batch 0" in result.message
    rows = [t for t in data["tensors"] if t["name"].startswith("step2.module.")]
    before = rows[:[t["name"] for t in rows].index(first["tensor"])]
    assert [t["name"] for t in before] == ["step2.module.mb0.module.model.embed_tokens",
                                           "step2.module.mb0.module.model.layers.0.input_layernorm"]
    assert all(t["status"] == "EQUAL" for t in before)
    assert next(t for t in rows if t["name"] == first["tensor"])["max_ulp"] == 1
    names = [t["name"] for t in rows]  # micro-batch 0's outputs, then the gradients that reached them, then mb 1's
    gradient = names.index(f"step2.module.mb0.refeed.grad_output.{MODULE}")
    assert names.index("step2.module.mb0.module.model.norm") < gradient
    assert gradient < names.index("step2.module.mb1.module.model.embed_tokens")


def test_a_planted_bit_in_a_modules_output_gradient_is_located_there(runs, tmp_path):
    result, run_dir = compare_runs(runs["a"], runs["grad"], reports_dir=tmp_path)
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    first = report(run_dir)["train"]["modules"]["first_divergence"]
    assert (first["module"], first["quantity"], first["step"], first["micro_batch"]) == (GRAD_MODULE, "output gradient",
                                                                                         2, 1)


def test_the_float64_truth_sides_with_the_run_without_the_planted_change(runs, tmp_path):
    result, run_dir = compare_runs(runs["a"], runs["big"], truth=runs["truth"], reports_dir=tmp_path)
    assert result.verdict == "DIFF", result.message
    first = report(run_dir)["train"]["modules"]["first_divergence"]
    assert first["module"] == MODULE and first["step"] == 2 and first["micro_batch"] == 0
    assert first["truth"]["side"] == "A" and first["truth"]["distance_b"] > 0.5 > first["truth"]["distance_a"]
    assert "at it the float64 truth sides with run A" in result.message


def test_a_run_against_itself_has_equal_module_outputs(runs, tmp_path):
    result, run_dir = compare_runs(runs["a"], runs["a"], reports_dir=tmp_path)
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert "module outputs bitwise equal at steps 2" in result.message
    assert report(run_dir)["train"]["modules"] == {"steps": [2], "first_divergence": None}


def test_a_step_captured_by_one_run_only_is_a_note(runs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(runs["a"], copy)
    shutil.rmtree(copy / "modules")
    result, _ = compare_runs(runs["a"], copy, reports_dir=tmp_path / "reports")
    assert result.verdict == "BITWISE_PASS", result.message
    assert "module outputs captured by run A only at steps 2: not compared" in result.message
