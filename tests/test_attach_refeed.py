"""The re-feed into a user's own loop (docs/attach.md, "Re-feed into your loop"): ``python -m harness state-for RUN_A
--step k --as RUN_B`` writes run A's state after step k, run B's recorder loads it before step k + 1
(``load_state``; the HF Trainer callback's ``state_from``), and ``compare-runs A B --refed R`` says which of step
k + 1's differences the step made and which it carried in.

- The torch loop of docs/attach.md (tests/support/torch_loop.py, tiny DeepSeek-V3, 2 steps): re-fed from its own
  state it gives its own bits; a difference planted at step 1 is carried into step 2, one planted at step 2 is made
  there; state-for and load_state refuse what they cannot do, naming the file, field or step.
- The real stacks on a registry training case (tests/support/train.py's tiny DeepSeek-V3, as
  tests/test_attach_megatron.py): the HF Trainer (docs/examples/attach/hf_trainer.py) re-fed from the Megatron-Core
  loop's capture (docs/examples/attach/megatron_loop.py) gives the built-in re-feed in time's result of the same case
  (``compare --refeed``, megatron_model against hf_model): the same tensors made by step 2 and carried into it; the
  Megatron-Core loop with the distributed optimizer re-fed from its own state gives its own bits, and re-fed from the
  Trainer's capture gives the built-in re-feed's result of hf_model against megatron_model.
"""

import argparse
import json

import pytest
import torch

from harness.attach.torch import AttachError, StepRecorder
from harness.commands import state_for
from harness.commands.compare_runs import compare_runs
from harness.compare.captured_runs import RunError
from tests.support.installed import absent
from tests.support.torch_loop import optimizer_of, tiny_model, train
from tests.support.train import TINY_MODEL

pytestmark = pytest.mark.skipif(absent("transformers"), reason="needs transformers")
PLANTED = "model.layers.0.mlp"  # +1.0 on its output's first element: at step 1 (call 1) or step 2 (call 3)


def refed(tmp_path, a, b, name="refed", **loop):
    """Run B's loop (the torch loop with `loop`'s options) re-fed from run A's state after step 1."""
    state = tmp_path / f"{name}-state"
    state_for.write(a, 1, b, state)
    folder, *_ = train(tmp_path / name, state_from=state, **loop)
    return folder


def report_of(a, b, tmp_path, **options):
    result, run_dir = compare_runs(a, b, reports_dir=tmp_path / "reports", **options)
    return result, json.loads((run_dir / "report.json").read_text())


def test_a_loop_refed_from_its_own_state_gives_its_own_bits(tmp_path):
    a, *_ = train(tmp_path / "a")
    again = refed(tmp_path, a, a)
    result, _ = report_of(a, again, tmp_path)
    assert result.verdict == "BITWISE_PASS", result.message  # loading changed no bit
    result, report = report_of(a, a, tmp_path, refed=again)
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert report["train"]["refed"]["status"] == "ok", report["train"]["refed"]
    assert report["train"]["refed"]["steps"][0]["attribution"] == {}
    said = json.loads((again / "meta.json").read_text())["capture"]["refed"]
    assert said["from"] == str(a.resolve()) and said["step"] == 1


def test_a_difference_made_at_step_1_is_carried_into_step_2(tmp_path):
    a, *_ = train(tmp_path / "a")
    plant = (PLANTED, 1, 1.0)
    b, *_ = train(tmp_path / "b", plant=plant)
    result, report = report_of(a, b, tmp_path, refed=refed(tmp_path, a, b, plant=plant))
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    step2 = report["train"]["refed"]["steps"][0]
    assert report["train"]["refed"]["status"] == "ok" and step2["step"] == 2
    assert {"loss", "grad", "exp_avg", "exp_avg_sq", "param"} <= set(step2["attribution"]), step2
    assert all(set(counts) <= {"carried in", "equal"} for counts in step2["counts"].values()), step2["attribution"]
    assert "re-fed at step 2 from run A's state after step 1: loss: 1 carried in" in result.message, result.message


def test_a_difference_made_at_step_2_is_made_there(tmp_path):
    a, *_ = train(tmp_path / "a")
    plant = (PLANTED, 3, 1.0)
    b, *_ = train(tmp_path / "b", plant=plant)
    result, report = report_of(a, b, tmp_path, refed=refed(tmp_path, a, b, plant=plant))
    assert result.verdict == "DIFF", result.message
    refeed = report["train"]["refed"]
    assert refeed["status"] == "ok", refeed  # A and B handed step 2 the same state: the re-fed step is B's
    step2 = refeed["steps"][0]
    assert {"loss", "grad", "param"} <= set(step2["attribution"]), step2
    assert all(set(counts) <= {"made by step 2", "equal"} for counts in step2["counts"].values()), step2
    assert step2["made"]["loss"] == ["step2.loss"]


def test_state_for_fails_closed_naming_what_is_missing(tmp_path):
    a, *_ = train(tmp_path / "a", steps_kept=[2])  # step 1 kept as digests only
    with pytest.raises(RunError, match=r"step00001\.safetensors lacks step1\.exp_avg\..* did not keep step 1's "
                                       r"tensors; record it with steps_kept including 1"):
        state_for.write(a, 1, a, tmp_path / "state")
    whole, *_ = train(tmp_path / "whole")
    with pytest.raises(RunError, match=r"--step 2: run A .* has steps 1 to 2; .* k is 1 to 1"):
        state_for.write(whole, 2, whole, tmp_path / "state")
    truth, *_ = train(tmp_path / "truth", float64=True)
    with pytest.raises(RunError, match=r"dtype: run A .* has 'float32', run B .* 'float64'"):
        state_for.write(whole, 1, truth, tmp_path / "state")
    assert not (tmp_path / "state").exists()
    (tmp_path / "taken").mkdir()
    code = state_for.main(argparse.Namespace(a=whole, step=1, b=whole, out=tmp_path / "taken"))
    assert code == 2 and not any((tmp_path / "taken").iterdir())  # never overwritten


def test_a_state_is_loaded_after_its_step_once_and_into_its_own_kind_of_loop(tmp_path):
    whole, *_ = train(tmp_path / "whole")
    state = tmp_path / "state"
    state_for.write(whole, 1, whole, state)
    model = tiny_model()
    recorder = StepRecorder(tmp_path / "fresh", model, optimizer_of(model), TINY_MODEL)
    with pytest.raises(AttachError, match="the state after step 1 is loaded after step 1's record, once; 0 steps"):
        recorder.load_state(state)
    sgd = StepRecorder(tmp_path / "sgd", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       TINY_MODEL)
    with pytest.raises(AttachError, match=r"state\.json: field optimizer is 'adamw', the loop loading it has 'sgd'"):
        sgd.load_state(state)


def test_compare_runs_refuses_a_run_that_was_not_refed(tmp_path):
    a, *_ = train(tmp_path / "a")
    result, _ = report_of(a, a, tmp_path, refed=a)
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert "has no capture.refed entry: its recorder loaded no state" in result.message, result.message
