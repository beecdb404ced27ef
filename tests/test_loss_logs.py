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
- Issue 40, finding 2: a record line is read whole or the run is refused naming its file, line and text (a skipped
  line shifted every later record a micro-batch: inf against -inf passed); a final loss that is not finite in both
  runs is an ERROR whatever its bits; a finite loss against an infinite one is a DIFF at its step.
"""

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.commands.compare_runs import compare_runs
from tests.fixtures.loss_logs import make

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
    ({"losses": [1.0, float("nan"), 2.0]}, "field 'losses' at step 2: nan is not a finite number"),
])
def test_a_bad_loss_json_is_an_error_naming_the_field(tmp_path, change, problem):
    artifact = {**json.loads((FIXTURES / "paddle_loss.json").read_text()), **change}
    bad = tmp_path / "loss.json"
    bad.write_text(json.dumps(artifact))
    result, _, _ = run(tmp_path, "paddle_loss.json", bad)
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert str(bad) in result.message and problem in result.message, result.message


def test_a_run_that_ended_early_is_an_error_naming_what_it_lacks(tmp_path):
    result, report, _ = run(tmp_path, "paddle", "torch_short", micro_batches=2)
    assert result.verdict == "ERROR" and result.exit_code == 2
    short = FIXTURES / "torch_short" / "train.log"
    assert (f"step3.loss_path.loss_input_logits.rank0.mb0: MISSING (only run A has it ({FIXTURES}/paddle/workerlog.0:"
            f"20); run B has 4 rank 0 loss_path loss_input_logits records (the last at {short}:15): it ended earlier"
            in result.message), result.message
    assert [s["verdict"] for s in report["train"]["steps"]] == ["BITWISE_PASS", "BITWISE_PASS", "ERROR"]
    reverse, _, _ = run(tmp_path, "torch_short", "paddle", micro_batches=2)
    assert reverse.verdict == "ERROR" and "MISSING (only run B has it" in reverse.message
    two_steps = {**json.loads((FIXTURES / "torch_loss_same.json").read_text())}
    two_steps.update(steps=[1, 2], losses=two_steps["losses"][:2])
    (tmp_path / "loss.json").write_text(json.dumps(two_steps))
    shorter, _, _ = run(tmp_path, "paddle_loss.json", tmp_path / "loss.json")
    assert shorter.verdict == "ERROR" and (f"step3.loss: MISSING (only run A has it ({FIXTURES}/paddle_loss.json "
                                           f"losses[2]); run B has 2 loss records (the last at {tmp_path}/loss.json "
                                           "losses[1])") in shorter.message, shorter.message


def one_rank_log(folder: Path, finals: dict | None = None, lines: dict | None = None) -> Path:
    """Rank 0's workerlog of 3 steps of one micro-batch in PaddleFleet's format (make.records: 4 lines a step, the
    final loss last): step k's final loss set to finals[k], line n (from 1) replaced by lines[n]."""
    text = []
    for step in range(1, 4):
        *path, final = make.records(step, 0, 0)
        text += [*path, make.final_loss_line(0, finals[step]) if step in (finals or {}) else final]
    for number, line in (lines or {}).items():
        text[number - 1] = line
    folder.mkdir(parents=True)
    (folder / "workerlog.0").write_text("\n".join(text) + "\n")
    return folder / "workerlog.0"


@pytest.mark.parametrize("a, b", [(float("inf"), float("-inf")), (float("nan"), float("nan")),
                                  (float("inf"), float("inf"))], ids=["inf-vs-minus-inf", "nan-both", "inf-both"])
def test_a_loss_not_finite_in_both_runs_is_an_error_naming_its_records(tmp_path, a, b):
    log_a, log_b = one_rank_log(tmp_path / "a", {2: a}), one_rank_log(tmp_path / "b", {2: b})
    assert f"val={a}" in log_a.read_text()  # printed as %.20f prints it: inf, -inf, nan
    result, report, _ = run(tmp_path, log_a, log_b)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert (f"step2.final_loss.rank0.mb0: NON_FINITE (non-finite loss in both runs: A {a} at {log_a}:8, B {b} at "
            f"{log_b}:8)") in result.message, result.message
    assert [s["verdict"] for s in report["train"]["steps"]] == ["BITWISE_PASS", "ERROR", "BITWISE_PASS"]


def test_a_finite_loss_against_an_infinite_one_differs_at_its_step(tmp_path):
    finite, infinite = one_rank_log(tmp_path / "a"), one_rank_log(tmp_path / "b", {2: float("inf")})
    result, report, _ = run(tmp_path, finite, infinite)
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    assert report["train"]["first_divergence"]["tensor"] == "step2.final_loss.rank0.mb0"
    assert [s["verdict"] for s in report["train"]["steps"]] == ["BITWISE_PASS", "DIFF", "BITWISE_PASS"]
    row = next(t for t in report["tensors"] if t["name"] == "step2.final_loss.rank0.mb0")
    assert row["status"] == "DIFF" and " vs inf (" in row["note"], row


@pytest.mark.parametrize("number, line", [
    (3, "per_token_loss: rank=0 shape=[1, 8] md5="),  # an empty md5
    (4, "final_loss: rank=0 val=3.47279381752014160156"),  # cut off before its md5
    (4, "final_loss: rank=0 val=loss md5=1cb2ee76fb22785497b73d8b49d3b760"),
    (4, "final_loss: rank=0 val=3.47279381752014160156 md5=1cb2ee76fb22785497b73d8b49d3b76"),  # 31 hex digits
    (1, "[LOSS_PATH_MD5] rank=0 loss_input_logits md5=65a59b60073d7cecacc235a1d9706161"),  # no shape
], ids=["empty-md5", "no-md5", "val-not-a-number", "md5-cut-off", "probe-without-shape"])
def test_a_record_line_that_does_not_read_whole_is_an_error_naming_it(tmp_path, number, line):
    good, bad = one_rank_log(tmp_path / "a"), one_rank_log(tmp_path / "b", lines={number: line})
    result, _, _ = run(tmp_path, good, bad)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert f"{bad}:{number}: " in result.message and repr(line) in result.message, result.message
    assert "ended earlier" not in result.message




def test_two_runs_cut_off_at_the_same_record_inside_a_step_are_an_error(tmp_path):
    # both runs stop after step 3's first micro-batch: equal records, but step 3 is not whole (2bab223 passed it)
    lines = (FIXTURES / "paddle" / "workerlog.0").read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if "final_loss:" in line)  # step 3, micro-batch 1's final loss
    start = max(i for i, line in enumerate(lines[:last]) if "final_loss:" in line)  # the one before it
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "workerlog.0").write_text("\n".join(lines[:start + 1]) + "\n")
    result, _, _ = run(tmp_path, tmp_path / "a", tmp_path / "b", micro_batches=2)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert "printed 5 records, not a whole number of steps of 2" in result.message, result.message


def test_a_rank_that_stopped_a_step_early_in_both_runs_is_an_error(tmp_path):
    # rank 1 lacks step 3 in both runs: every record present is equal (2bab223 passed it)
    source = FIXTURES / "paddle"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "workerlog.0").write_text((source / "workerlog.0").read_text())
        rank1 = (source / "workerlog.1").read_text().splitlines()
        finals = [i for i, line in enumerate(rank1) if "final_loss:" in line]
        (tmp_path / name / "workerlog.1").write_text("\n".join(rank1[:finals[3] + 1]) + "\n")
    result, _, _ = run(tmp_path, tmp_path / "a", tmp_path / "b", micro_batches=2)
    assert result.verdict == "ERROR" and result.exit_code == 2, result.message
    assert "its ranks printed different numbers of loss records" in result.message, result.message


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
