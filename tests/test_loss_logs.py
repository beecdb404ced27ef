"""Loss-only runs (harness/compare/loss_logs.py) through ``compare-runs``: the logs and loss.json PaddleFleet's
``compare_loss.py`` reads, made here in its formats (tests/fixtures/loss_logs/make.py: real float32 cross entropies,
md5s of their bytes, 2 ranks, 3 steps of 2 micro-batches).

- Equal losses printed in two layouts (a file per rank with colours; both ranks in one file, sharing lines) pass,
  exit 0; one planted logit is found at its step, micro-batch and rank, first on the loss path, and the final loss
  says how many float32 ULPs apart it is; a logit change that leaves the losses' bits alone (which compare_loss.py
  passes) is found on the loss path.
- Two losses per micro-batch printed in opposite orders (DSv4's main/MTP) pass once each side's order is given, and
  do not without it (the order matters).
- loss.json: bit-for-bit per step, a one-ULP step named with its ULPs; a bad artifact is an error naming the field.
- A run that ended early, a printed value that does not reproduce its md5, a step folder against a log.
"""

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.commands.compare_runs import compare_runs

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "loss_logs"


def run(tmp_path, a, b, **options):
    result, run_dir = compare_runs(FIXTURES / a if isinstance(a, str) else a, FIXTURES / b if isinstance(b, str)
                                   else b, reports_dir=tmp_path, **options)
    return result, json.loads((run_dir / "report.json").read_text()), run_dir


def test_equal_losses_in_two_log_layouts_pass(tmp_path):
    result, report, run_dir = run(tmp_path, "paddle", "torch_same", micro_batches=2)
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    steps = report["train"]["steps"]
    assert [s["verdict"] for s in steps] == ["BITWISE_PASS"] * 3
    assert steps[0]["quantities"] == {"loss_path": {"equal": 8, "total": 8, "differing": []},
                                      "per_token_loss": {"equal": 4, "total": 4, "differing": []},
                                      "final_loss": {"equal": 4, "total": 4, "differing": []}}
    assert "step1.final_loss.rank1.mb0" in {t["name"] for t in report["tensors"]}
    assert "loss only" in (run_dir / "report.md").read_text()


def test_a_planted_logit_is_found_at_its_step_micro_batch_and_rank(tmp_path):
    result, report, _ = run(tmp_path, "paddle", "torch_planted", micro_batches=2)
    assert result.verdict == "DIFF" and result.exit_code == 1
    train = report["train"]
    assert [s["verdict"] for s in train["steps"]] == ["BITWISE_PASS", "DIFF", "BITWISE_PASS"]
    assert train["first_divergence"] == {"step": 2, "quantity": "loss_path",
                                         "tensor": "step2.loss_path.loss_input_logits.rank1.mb1"}
    differing = {t["name"]: t for t in report["tensors"] if t["status"] != "EQUAL"}
    assert set(differing) == {"step2.loss_path.loss_input_logits.rank1.mb1", "step2.per_token_loss.rank1.mb1",
                              "step2.final_loss.rank1.mb1"}
    final = differing["step2.final_loss.rank1.mb1"]  # its val reproduces its md5 on both sides: bits known
    assert final["dtype"] == "float32" and final["max_ulp"] == 59, final
    assert "3.60305666923522949219 vs 3.60304260253906250000" in final["note"]


def test_a_difference_the_loss_md5s_miss_is_found_on_the_loss_path(tmp_path):
    result, report, _ = run(tmp_path, "paddle", "torch_path_only", micro_batches=2)
    assert result.verdict == "DIFF"
    step2 = report["train"]["steps"][1]
    assert step2["quantities"]["per_token_loss"]["equal"] == 4 and step2["quantities"]["final_loss"]["equal"] == 4
    assert step2["quantities"]["loss_path"]["differing"] == ["step2.loss_path.loss_input_logits.rank1.mb1"]


def test_losses_printed_in_opposite_orders_pair_up_once_each_order_is_given(tmp_path):
    result, report, _ = run(tmp_path, "dsv4_paddle", "dsv4_megatron", micro_batches=2,
                            losses=(("main", "mtp"), ("mtp", "main")))
    assert result.verdict == "BITWISE_PASS", result.message
    assert report["train"]["steps"][0]["quantities"]["final_loss"] == {"equal": 4, "total": 4, "differing": []}
    assert "step3.final_loss.rank0.mb1.mtp" in {t["name"] for t in report["tensors"]}
    wrong, _, _ = run(tmp_path, "dsv4_paddle", "dsv4_megatron", micro_batches=2, losses=(("main", "mtp"),) * 2)
    assert wrong.verdict == "DIFF"


def test_loss_json_is_compared_bit_for_bit_per_step(tmp_path):
    same, report, _ = run(tmp_path, "paddle_loss.json", "torch_loss_same.json")
    assert same.verdict == "BITWISE_PASS" and [s["scalars"]["loss"]["equal"] for s in report["train"]["steps"]] \
        == [True] * 3
    planted, report, _ = run(tmp_path, "paddle_loss.json", "torch_loss_planted.json")
    assert planted.verdict == "DIFF" and planted.exit_code == 1
    assert report["train"]["first_divergence"] == {"step": 3, "quantity": "loss", "tensor": "step3.loss"}
    loss = report["train"]["steps"][2]["scalars"]["loss"]
    assert loss["equal"] is False and loss["ulps"] == 1 and loss["unit"] == "float64 ULP"


@pytest.mark.parametrize("change, problem", [
    ({"schema": "other"}, "field 'schema' must be 'glm52-machine-loss/v1' (got 'other')"),
    ({"stage": "training"}, "field 'stage' must be 'training_callback_complete'"),
    ({"steps": [1, 3, 2]}, "field 'steps' must be 1..3 in order"),
    ({"losses": [1.0, True, 2.0]}, "field 'losses' at step 2: True is not a finite number"),
])
def test_a_bad_loss_json_is_an_error_naming_the_field(tmp_path, change, problem):
    artifact = {**json.loads((FIXTURES / "paddle_loss.json").read_text()), **change}
    bad = tmp_path / "loss.json"
    bad.write_text(json.dumps(artifact))
    result, _, _ = run(tmp_path, "paddle_loss.json", bad)
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert str(bad) in result.message and problem in result.message, result.message


def test_a_run_that_ended_early_is_an_error_naming_what_it_lacks(tmp_path):
    result, _, _ = run(tmp_path, "paddle", "torch_short", micro_batches=2)
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert "step3.loss_path.loss_input_logits.rank0.mb0: MISSING (only run A has it" in result.message
    assert "paddle/workerlog.0:" in result.message


def test_a_value_that_does_not_reproduce_its_md5_is_compared_by_md5(tmp_path):
    text = (FIXTURES / "paddle" / "workerlog.0").read_text()
    short = text.replace("val=3.47279381752014160156", "val=3.472794")  # fewer digits: not the float32 printed
    assert short != text
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "workerlog.0").write_text(short)
    result, report, _ = run(tmp_path, FIXTURES / "paddle" / "workerlog.0", tmp_path / "logs", micro_batches=2)
    assert result.verdict == "BITWISE_PASS", result.message  # the md5s agree
    row = next(t for t in report["tensors"] if t["name"] == "step1.final_loss.rank0.mb0")
    assert "val 3.47279381752014160156 vs 3.472794; compared by md5" in row["note"], row


def test_a_log_without_loss_lines_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty.log").write_text("[INFO] nothing here\n")
    result, _, _ = run(tmp_path, "paddle", tmp_path / "empty.log")
    assert result.verdict == "ERROR" and "empty.log: no per_token_loss or final_loss line" in result.message


def test_a_step_folder_and_a_log_are_not_compared(tmp_path):
    folder = tmp_path / "steps-double"  # a test double: only the shape of a step folder (the kinds are told apart)
    (folder / "steps").mkdir(parents=True)
    assert main(["compare-runs", str(folder), str(FIXTURES / "paddle"), "--reports", str(tmp_path)]) == 2


def test_the_command_line_reads_the_gates_options(tmp_path):
    arguments = ["compare-runs", str(FIXTURES / "dsv4_paddle"), str(FIXTURES / "dsv4_megatron"), "--micro-batches",
                 "2", "--losses-a", "main,mtp", "--losses-b", "mtp,main", "--reports", str(tmp_path)]
    assert main(arguments) == 0
    assert main(["compare-runs", str(FIXTURES / "paddle"), str(FIXTURES / "torch_planted"), "--micro-batches", "2",
                 "--reports", str(tmp_path)]) == 1
