"""``StepRecorder`` in a plain torch loop (harness/attach/torch.py; docs/attach.md "Any torch loop"): the tiny
DeepSeek-V3 of tests/support/train.py in HF transformers, initialised by transformers from a seed, trained 2 steps of
2 micro-batches with torch.optim.AdamW and clip_grad_norm_, the loop written as docs/attach.md shows it.

- Two runs of the same loop, one keeping every step's tensors and one keeping step 1's only, are bitwise equal
  through compare-runs (step 2 by digest): the digests of a step not kept stand for its tensors.
- A loop that decays every parameter against one that leaves the 1-D ones undecayed is an ERROR naming
  weight_decay_params with both values (compare-runs compares no runs of other training settings).
- The recorder refuses a step out of order, a step with another number of micro-batches, and an optimizer the harness
  has no record of, each naming it.
"""

import json

import pytest
import torch

from harness.commands.compare_runs import compare_runs
from harness.families import model_config
from tests.support.installed import absent
from tests.support.train import TINY_MODEL

pytestmark = pytest.mark.skipif(absent("transformers"), reason="needs transformers")


def tiny_model():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from harness.families.deepseek_v3.hf import hf_config

    torch.manual_seed(0)
    model = hf.DeepseekV3ForCausalLM(hf_config(model_config(TINY_MODEL), hf))
    model.train()
    return model


def train(folder, *, steps_kept="all", not_1d=True):
    """The loop of docs/attach.md, "Any torch loop"."""
    from harness.attach.torch import StepRecorder

    model = tiny_model()
    params = list(model.parameters())
    groups = ([{"params": [p for p in params if p.dim() > 1]},
               {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}] if not_1d
              else [{"params": params}])
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    recorder = StepRecorder(folder, model, optimizer, TINY_MODEL, steps_kept=steps_kept, stated={"clip_grad": 1.0})
    data = torch.Generator().manual_seed(1)
    for step in (1, 2):
        losses = []
        for _ in range(2):
            ids = torch.randint(0, TINY_MODEL["vocab_size"], (1, 8), generator=data)
            labels = torch.randint(0, TINY_MODEL["vocab_size"], (1, 8), generator=data)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = model.loss_function(logits=logits, labels=None, vocab_size=TINY_MODEL["vocab_size"],
                                       shift_labels=labels) / 2
            loss.backward()
            losses.append(loss.detach())
        grads = recorder.grads()
        norm, factor = recorder.clip_grad_norm_(model.parameters(), 1.0)  # the model's order, both runs
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        recorder.record(step, losses, lr, grads, grad_norm=norm, clip_coeff=factor)
        optimizer.zero_grad()
    return folder


def test_a_step_kept_as_digests_compares_as_its_tensors(tmp_path):
    kept = train(tmp_path / "kept")
    digests = train(tmp_path / "digests", steps_kept=[1])
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
    result, _ = compare_runs(train(tmp_path / "not_1d"), train(tmp_path / "all", not_1d=False), reports_dir=tmp_path)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert "weight_decay_params: 'not_1d' in run A, 'all' in run B" in result.message, result.message


def test_the_recorder_refuses_what_it_cannot_record(tmp_path):
    from harness.attach.torch import AttachError, StepRecorder

    model = tiny_model()
    with pytest.raises(AttachError, match=r"optimizer torch.optim.adam.Adam: the recorder writes the state of AdamW"):
        StepRecorder(tmp_path / "adam", model, torch.optim.Adam(model.parameters()), TINY_MODEL)
    with pytest.raises(AttachError, match=r"model_config: .*'no_such_key'"):
        StepRecorder(tmp_path / "bad", model, torch.optim.AdamW(model.parameters()), {**TINY_MODEL, "no_such_key": 1})
    recorder = StepRecorder(tmp_path / "r", model, torch.optim.AdamW(model.parameters()), TINY_MODEL)
    with pytest.raises(AttachError, match=r"step 2 recorded after 0 steps: .*expected 1"):
        recorder.record(2, [torch.tensor(1.0)], 1e-3, {})
    recorder.micro_batches = 2  # as if step 1 had two micro-batches
    with pytest.raises(AttachError, match=r"step 1 has 1 micro-batch losses, step 1 had 2"):
        recorder.record(1, [torch.tensor(1.0)], 1e-3, {})
