"""``StepRecorder`` in a plain torch loop (harness/attach/torch.py; docs/attach.md "Any torch loop"): the tiny
DeepSeek-V3 of tests/support/train.py in HF transformers, initialised by transformers from a seed, trained 2 steps of
2 micro-batches with torch.optim.AdamW and clip_grad_norm_, the loop written as docs/attach.md shows it.

- Two runs of the same loop, one keeping every step's tensors and one keeping step 1's only, are bitwise equal
  through compare-runs (step 2 by digest): the digests of a step not kept stand for its tensors.
- A loop that decays every parameter against one that leaves the 1-D ones undecayed is an ERROR naming
  weight_decay_params with both values (compare-runs compares no runs of other training settings).
- The recorded loop ends with the unrecorded loop's bits (every parameter, every optimizer state tensor), also where
  one parameter's gradient is None (dropped by a hook): the recorder writes zeros for it, leaves its ``.grad`` None
  and names it in meta.json (issue 40, finding 3).
- At construction the recorder refuses what its record could not describe: an optimizer the harness has no record
  of, a trained parameter the family's name map does not read (finding 4), AdamW's amsgrad or maximize, SGD's
  maximize or nesterov, a bfloat16 model without fp32 masters (finding 10); it lists an optimizer flag that keeps
  the math (differentiable) in meta.json.
- An error while recording (a step out of order, another number of micro-batches, a disk that fills at step 2: a
  test double of the writer's save) stops the recording, not the loop: the loop trains to the end with the
  unrecorded loop's bits, one warning is logged, meta.json says at which step and why, and compare-runs refuses the
  run (ERROR) rather than passing the steps before (finding 10).
- Digests where the tensors are (issue 43; ``digest_on_device=True``: a GPU's code path, bits128v1 in torch, with the
  CPU's tensors, the gradients digested when handed over instead of copied): every digest of a step not kept is the
  host reference's digest of the tensor a run keeping every step wrote, compare-runs passes the two runs, and one bit
  flipped in one gradient is found at that gradient, the 41 others equal. ``steps_kept="auto"`` keeps every step of
  a small model and none above ``KEEP_ALL_BYTES``.
"""

import json
import logging

import pytest
import torch
from safetensors.numpy import load_file

from harness.attach import torch as attach_torch
from harness.attach.torch import AttachError, StepRecorder
from harness.commands.compare_runs import compare_runs
from harness.run import bits128
from harness.run.steps import read_header, step_file
from tests.support.installed import absent
from tests.support.torch_loop import DROPPED, assert_same_bits, disk_full_at_step_2, final_bits, tiny_model, train
from tests.support.train import TINY_MODEL

pytestmark = pytest.mark.skipif(absent("transformers"), reason="needs transformers")


def test_a_step_kept_as_digests_compares_as_its_tensors(tmp_path):
    kept, *_ = train(tmp_path / "kept")
    digests, *_ = train(tmp_path / "digests", steps_kept=[1])
    result, run_dir = compare_runs(kept, digests, reports_dir=tmp_path)
    report = json.loads((run_dir / "report.json").read_text())
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    step2 = [t for t in report["tensors"] if t["name"].startswith("step2.") and "." in t["name"][6:]]
    by_digest = [t for t in step2 if t["note"] == "compared by digest (step not kept)"]
    assert len(by_digest) == 42 * 4 + 1  # gradients, 2 moments, parameters of the 42; the routing bias
    assert report["train"]["steps_kept"] == [1]


def test_another_weight_decay_is_an_error_naming_it(tmp_path):
    """The two loops' step files part at step 1's 1-D parameters; the recorders' descriptions say why before any file
    is read: compare-runs refuses runs of other training settings (issue 40)."""
    result, _ = compare_runs(train(tmp_path / "not_1d")[0], train(tmp_path / "all", not_1d=False)[0],
                             reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert "weight_decay_params: 'not_1d' in run A, 'all' in run B" in result.message, result.message


@pytest.mark.parametrize("drop", [None, DROPPED])
def test_the_recorded_loop_ends_with_the_unrecorded_loops_bits(drop, tmp_path):
    _, model, optimizer = train(tmp_path / "recorded", drop=drop)
    _, bare_model, bare_optimizer = train(None, recorded=False, drop=drop)
    assert_same_bits(final_bits(model, optimizer), final_bits(bare_model, bare_optimizer))
    assert len(optimizer.state_dict()["state"]) == 30 - (drop is not None)  # AdamW never stepped the dropped one
    meta = json.loads((tmp_path / "recorded" / "meta.json").read_text())
    assert [s.get("without_grad") for s in meta["capture"]["steps"]] == [[drop] if drop else None] * 2
    if drop:  # the step file holds zeros for it: the up half of the canonical gate_up_proj (cat0 of gate, up)
        from safetensors.torch import load_file

        written = load_file(tmp_path / "recorded" / "steps" / "step00001.safetensors")
        gate_up = written["step1.grad.model.layers.0.mlp.gate_up_proj.weight"]
        half = TINY_MODEL["intermediate_size"]
        assert gate_up[:half].any() and not gate_up[half:].any()
        result, _ = compare_runs(tmp_path / "recorded", tmp_path / "recorded", reports_dir=tmp_path / "reports")
        assert result.verdict == "BITWISE_PASS", result.message
        assert f"run A, step 1: 1 parameter(s) without a gradient, written as zeros: {drop}" in result.message


def test_the_recorder_refuses_what_it_cannot_describe(tmp_path):
    model = tiny_model()
    refused = {
        "optimizer torch.optim.adam.Adam: the recorder writes the state of AdamW": torch.optim.Adam(model.parameters()),
        "AdamW with amsgrad=True: the adamw record is its math without amsgrad":
            torch.optim.AdamW(model.parameters(), amsgrad=True),
        "AdamW with maximize=True: the adamw record": torch.optim.AdamW(model.parameters(), maximize=True),
        "SGD with maximize=True: the sgd record": torch.optim.SGD(model.parameters(), momentum=0.9, maximize=True),
        "SGD with nesterov=True: the sgd record": torch.optim.SGD(model.parameters(), momentum=0.9, nesterov=True),
    }
    for message, optimizer in refused.items():
        with pytest.raises(AttachError, match=message):
            StepRecorder(tmp_path / "refused", model, optimizer, TINY_MODEL)
    with pytest.raises(AttachError, match=r"model_config: .*'no_such_key'"):
        StepRecorder(tmp_path / "bad", model, torch.optim.AdamW(model.parameters()), {**TINY_MODEL, "no_such_key": 1})
    model.extra = torch.nn.Parameter(torch.zeros(3))  # trained, outside the family's name map
    with pytest.raises(AttachError, match=r"trained parameters extra \(1\): in the optimizer's param groups, read by "
                                          r"no rule of the deepseek_v3 name map"):
        StepRecorder(tmp_path / "extra", model, torch.optim.AdamW(model.parameters()), TINY_MODEL)
    del model.extra
    with pytest.raises(AttachError, match=r"dtype bfloat16 without fp32 master weights: .* pass masters="):
        StepRecorder(tmp_path / "bf16", model.to(torch.bfloat16), torch.optim.AdamW(model.parameters()), TINY_MODEL)


def test_a_flag_that_keeps_the_math_is_listed(tmp_path):
    model = tiny_model()
    recorder = StepRecorder(tmp_path, model, torch.optim.AdamW(model.parameters(), differentiable=True), TINY_MODEL)
    recorder.write_meta()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["capture"]["not_described"] == {"optimizer_flags": {"differentiable": True}}


def test_an_error_while_recording_stops_the_recording_not_the_loop(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="harness.attach.torch"):
        folder, model, optimizer = train(tmp_path / "full", steps=3, writer=disk_full_at_step_2)
    _, bare_model, bare_optimizer = train(None, recorded=False, steps=3)
    assert_same_bits(final_bits(model, optimizer), final_bits(bare_model, bare_optimizer))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "recording stopped at step 2" in warnings[0], warnings
    capture = json.loads((folder / "meta.json").read_text())["capture"]
    assert capture["stopped"] == {"step": 2, "error": "OSError: [Errno 28] No space left on device (test double)"}
    assert [s["step"] for s in capture["steps"]] == [1] and capture["config"]["train"]["steps"] == 2
    whole, *_ = train(tmp_path / "whole")
    result, _ = compare_runs(whole, folder, reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert "its recorder stopped recording at step 2 (OSError" in result.message, result.message


def test_a_misused_recorder_stops_with_a_note(tmp_path):
    model = tiny_model()
    recorder = StepRecorder(tmp_path / "order", model, torch.optim.AdamW(model.parameters()), TINY_MODEL)
    recorder.record(2, [torch.tensor(1.0)], 1e-3, {})  # returns
    stopped = json.loads((tmp_path / "order" / "meta.json").read_text())["capture"]["stopped"]
    assert stopped == {"step": 2, "error": "AttachError: step 2 recorded after 0 steps: record every step, in "
                                           "order (expected 1)"}
    recorder = StepRecorder(tmp_path / "count", model, torch.optim.AdamW(model.parameters()), TINY_MODEL)
    recorder.micro_batches = 2  # as if step 1 had two micro-batches
    recorder.record(1, [torch.tensor(1.0)], 1e-3, {})
    stopped = json.loads((tmp_path / "count" / "meta.json").read_text())["capture"]["stopped"]
    assert stopped["error"] == "AttachError: step 1 has 1 micro-batch losses, step 1 had 2"


def test_a_trainers_schedule_is_read_from_its_value_and_another_shape_is_refused():
    # str(SchedulerType.COSINE) is "SchedulerType.COSINE": read as text, every cosine run was described "constant"
    from transformers.trainer_utils import SchedulerType

    from harness.attach.torch import decay_style

    assert [decay_style(SchedulerType(name)) for name in ("cosine", "cosine_with_min_lr", "constant",
                                                          "constant_with_warmup")] == ["cosine"] * 2 + ["constant"] * 2
    with pytest.raises(AttachError, match=r"lr_scheduler_type 'linear': the training settings describe cosine"):
        decay_style(SchedulerType("linear"))


FLIPPED = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # its canonical name is its HF name


def test_digests_made_where_the_tensors_are_are_the_host_digests_and_find_one_flipped_bit(tmp_path):
    kept, *_ = train(tmp_path / "kept")
    device, *_ = train(tmp_path / "device", steps_kept="none", digest_on_device=True)
    meta = json.loads((device / "meta.json").read_text())
    assert meta["step_digests"] == "bits128v1 in torch elementwise ops" and meta["steps_kept"] == "none"
    for step in (1, 2):
        header, tensors = read_header(step_file(device, step)), load_file(step_file(kept, step))
        assert not header.kept and set(header.layouts) == {f"step{step}.{s}" for s in ("lr", "loss", "grad_norm",
                                                                                         "clip_coeff")}
        assert header.digests == {name: bits128.digest_numpy(value) for name, value in tensors.items()
                                  if name not in header.layouts}
    result, _ = compare_runs(kept, device, reports_dir=tmp_path / "same")
    assert result.verdict == "BITWISE_PASS", result.message
    flipped, *_ = train(tmp_path / "flipped", steps_kept="none", digest_on_device=True, flip_grad=FLIPPED)
    result, run_dir = compare_runs(device, flipped, reports_dir=tmp_path / "flip")
    report = json.loads((run_dir / "report.json").read_text())["train"]
    assert result.verdict == "DIFF", result.message
    assert report["first_divergence"] == {"step": 1, "quantity": "grad", "tensor": f"step1.grad.{FLIPPED}"}
    assert report["steps"][0]["quantities"]["grad"]["equal"] == 41, report["steps"][0]


def test_auto_keeps_every_step_of_a_small_model_and_none_of_a_large_one(tmp_path, monkeypatch):
    model = tiny_model()
    small = StepRecorder(tmp_path / "small", model, torch.optim.AdamW(model.parameters()), TINY_MODEL)
    assert small.kept_setting == "all" and small.writer.digests is None  # the CPU: the host's XXH3
    monkeypatch.setattr(attach_torch, "KEEP_ALL_BYTES", small._state_bytes() - 1)
    large = StepRecorder(tmp_path / "large", model, torch.optim.AdamW(model.parameters()), TINY_MODEL)
    assert large.kept_setting == "none" and large.kept == set()
