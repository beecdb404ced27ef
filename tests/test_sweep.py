"""Token and runner-pair sweeps: the command line, the exit-code rule, and one real sweep end to end."""

import json

import pytest

from harness import cli
from harness.case.registry import CaseError, Registry
from harness.commands import sweep
from harness.commands.compare import CompareOptions
from tests.support.cases import tiny_case, write_cases


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
        assert cell["verdict"] in ("BITWISE_PASS", "DIFF"), cell["message"]
        cell_report = json.loads((sweep_dir / cell["run_dir"] / "report.json").read_text())
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
