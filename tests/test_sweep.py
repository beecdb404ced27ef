"""Token and runner-pair sweeps: the command line, the exit-code rule, and one real sweep end to end."""

import json
from pathlib import Path

import pytest

from harness import CompareOptions, cli
from harness.case.checkpoints import load_tensors
from harness.case.registry import CaseError, Registry
from harness.commands import sweep
from tests.support.cases import tiny_case, write_cases
from tests.support.e2e import assert_counts_match_outputs, verdict_of


def test_tokens_accepts_one_count_or_a_list():
    assert cli.token_counts("60") == [60]
    assert cli.token_counts("1,7,60,4096") == [1, 7, 60, 4096]
    for bad in ("", "1,,2", "0", "-3", "sixty"):
        with pytest.raises(Exception, match="positive integers separated by commas"):
            cli.token_counts(bad)


def test_runner_pair_names_two_known_runners():
    assert cli.runner_pair("megatron,torch_nn") == ("megatron", "torch_nn")
    for bad in ("megatron", "megatron,torch,paddle", "megatron,tensorflow"):
        with pytest.raises(Exception, match="expects two of megatron, paddle, torch, torch_nn"):
            cli.runner_pair(bad)


def test_another_pair_keeps_a_control_expectation_and_resets_a_stated_difference():
    registry = Registry.load()
    fp32 = registry.get("kimi_shared_fc1_fp32").with_runners(("megatron", "torch"))
    assert fp32.runners == ("megatron", "torch") and fp32.expect.verdict == "BITWISE_PASS"
    control = registry.get("kimi_shared_fc1_control_megatron").with_runners(("torch", "torch"))
    assert control.expect.verdict == "DIFF" and control.expect.differs == ("out", "grad.weight")
    with pytest.raises(CaseError, match="runners must be two of .*got 'megatron,jax'"):
        registry.get("kimi_shared_fc1").with_runners(("megatron", "jax"))


@pytest.mark.parametrize("codes, expected", [
    ([0, 0], 0), ([0, 3], 3), ([3, 1, 0], 1), ([1, 2, 3], 2),
])
def test_sweep_exit_code_takes_the_worst_cell(codes, expected):
    assert sweep.exit_code([{"exit_code": code} for code in codes]) == expected


@pytest.mark.e2e
def test_sweep_over_tokens_and_both_torch_layouts(tmp_path):
    write_cases(tmp_path, tiny_case(shapes={"input_size": 64, "output_size": 32}))
    lines = []
    report, sweep_dir = sweep.run_sweep(
        "tiny", [1, 7], [("megatron", "torch"), ("megatron", "torch_nn")],
        CompareOptions(reports_dir=tmp_path / "reports", cases_dir=tmp_path / "cases", checkpoints_dir=tmp_path / "ck",
                       oracle=False), progress=lines.append)

    assert [(c["pair"], c["tokens"]) for c in report["cells"]] == [
        ("megatron vs torch", 1), ("megatron vs torch", 7), ("megatron vs torch_nn", 1), ("megatron vs torch_nn", 7)]
    assert len(lines) == 4 and lines[0].startswith("[1/4] tiny megatron vs torch tokens=1: ")
    assert report["tensors"] == ["out", "grad.input", "grad.weight"]
    for cell in report["cells"]:
        cell_report = json.loads((sweep_dir / cell["run_dir"] / "report.json").read_text())
        outputs = [load_tensors(Path(side["folder"]) / "outputs.safetensors") for side in cell_report["sides"]]
        assert_counts_match_outputs(cell_report, *outputs)
        assert cell["verdict"] == verdict_of(cell_report), cell["message"]
        assert cell_report["case"]["tokens"] == cell["tokens"]
        assert cell_report["case"]["runners"] == cell["runners"]
        assert {t["name"]: t["mismatches"] for t in cell_report["tensors"]} == {
            name: t["mismatches"] for name, t in cell["tensors"].items()}
    tn = [c for c in report["cells"] if c["pair"] == "megatron vs torch"]
    assert all(c["verdict"] == "BITWISE_PASS" for c in tn)  # the same torch calls as Megatron's layer
    assert report["exit_code"] == sweep.exit_code(report["cells"])

    saved = json.loads((sweep_dir / "report.json").read_text())
    assert saved["cells"] == report["cells"] and saved["kind"] == "sweep"
    text = (sweep_dir / "report.md").read_text()
    assert "## megatron vs torch_nn" in text and "| tokens | verdict | out | grad.input | grad.weight |" in text
    assert "| 7 | BITWISE_PASS | = | = | = |" in text
    assert set(saved["provenance"]) == {"megatron", "torch", "torch_nn"}


class _Cells:
    """Test doubles for the two halves of a comparison (``compare.start_case``/``finish_case``), so the sweep's own
    pipelining is tested alone: which cells start, which get a report, in which order. `finish_hook(tokens)` runs in
    the finisher thread before a cell's report is written."""

    def __init__(self, monkeypatch, start_error=None, finish_hook=None):
        self.started, self.finished, self.start_returned = [], [], {}
        self.start_error, self.finish_hook = start_error or {}, finish_hook or (lambda tokens: None)
        monkeypatch.setattr(sweep.pipeline, "start_case", self.start_case)
        monkeypatch.setattr(sweep.pipeline, "finish_case", self.finish_case)

    def start_case(self, name, options):
        import threading

        from harness.compare.result import CaseResult
        from harness.pipeline import Started

        run_dir = Path(options.reports_dir) / f"{name}-{options.tokens}"
        run_dir.mkdir()
        result = CaseResult(run_id=run_dir.name, case_name=name, device="cpu",
                            case={"tokens": options.tokens, "runners": ["megatron", "torch"]})
        self.started.append(options.tokens)
        begun = Started(result, run_dir, options, clock=None, error=self.start_error.get(options.tokens))
        self.start_returned.setdefault(options.tokens, threading.Event()).set()
        return begun

    def finish_case(self, begun):
        from harness.compare.result import ERROR
        from harness.run import supervisor

        tokens = begun.result.case["tokens"]
        self.finish_hook(tokens)
        begun.result.verdict = ERROR if begun.error else "BITWISE_PASS"
        (begun.run_dir / "report.json").write_text(json.dumps({"tokens": tokens, "verdict": begun.result.verdict}))
        self.finished.append(tokens)
        if begun.error is not None:  # as failsafe.finish: an interrupted run re-raises once its report is written
            raise supervisor.Interrupted(2)
        return begun.result, begun.run_dir

    def wait_started(self, tokens):
        import threading

        assert self.start_returned.setdefault(tokens, threading.Event()).wait(30), f"cell {tokens} never started"


def test_a_sweep_finishes_each_cell_while_the_next_one_runs_and_in_order(tmp_path, monkeypatch):
    cells = _Cells(monkeypatch, finish_hook=lambda tokens: tokens < 3 and cells.wait_started(tokens + 1))
    report, sweep_dir = sweep.run_sweep("tiny", [1, 2, 3], options=CompareOptions(reports_dir=tmp_path),
                                        progress=lambda line: None)
    assert cells.started == cells.finished == [1, 2, 3]  # cell k finished only once cell k + 1 had started
    assert [(cell["tokens"], cell["run_dir"]) for cell in report["cells"]] == [(k, f"tiny-{k}") for k in (1, 2, 3)]
    assert all(json.loads((sweep_dir / f"tiny-{k}" / "report.json").read_text())["tokens"] == k for k in (1, 2, 3))


def test_a_cell_started_before_the_sweep_stops_still_gets_its_report(tmp_path, monkeypatch):
    """The cell before fails to write its report (a full disk) while this one's sides have run: the sweep stops with
    that error, and this cell still gets its report (and its oracle's round ends before the workers close)."""
    from harness import resources

    def disk_full_after_the_next_cell_started(tokens):
        if tokens == 1:
            cells.wait_started(2)
            raise resources.StorageError("cannot write report: no space left on device")

    cells = _Cells(monkeypatch, finish_hook=disk_full_after_the_next_cell_started)
    with pytest.raises(resources.StorageError, match="no space left"):
        sweep.run_sweep("tiny", [1, 2, 3], options=CompareOptions(reports_dir=tmp_path), progress=lambda line: None)
    assert cells.started == [1, 2] and cells.finished == [2]
    assert json.loads(next(tmp_path.glob("*-sweep-tiny-*/tiny-2/report.json")).read_text())["tokens"] == 2


def test_an_interrupted_cell_stops_the_sweep_without_the_command_lines_signal_handlers(tmp_path, monkeypatch):
    """Ctrl-C in a library caller (no handlers installed: KeyboardInterrupt inside the cell): that cell's report says
    so and no further cell starts its runners."""
    from harness.run import supervisor

    cells = _Cells(monkeypatch, start_error={1: KeyboardInterrupt()})
    with pytest.raises(supervisor.Interrupted):
        sweep.run_sweep("tiny", [1, 2, 3], options=CompareOptions(reports_dir=tmp_path), progress=lambda line: None)
    assert cells.started == cells.finished == [1]
