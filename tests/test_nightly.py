"""`python -m harness nightly`: outcomes, finding the previous night, and one real run over a tiny registry.

The end-to-end test runs the real Megatron-Core runner on both sides of an fp32 64x32 layer with one
input bit flipped on side b, in a case that (wrongly) expects bitwise equality: the night must fail on it,
skip a case that needs a weights file nobody gave, leave out a GPU-only case, and report the trend against
a planted previous night in which that case passed.
"""

import json
import xml.etree.ElementTree as ET

import pytest

from harness import CompareOptions
from harness.cli import main
from harness.commands import nightly
from harness.compare.result import CaseResult
from tests.support.cases import tiny_case, write_cases

TINY_CASES = (
    tiny_case("tiny_flipped", description="Megatron vs Megatron with bit 6 of input[3, 5] flipped on side b, yet "
              "expected bitwise equal", seed=7, tokens=8, shapes={"input_size": 64, "output_size": 32},
              runners=["megatron", "megatron"], devices=["cpu"],
              perturb={"side": "b", "tensor": "input", "index": [3, 5], "bit": 6}),
    tiny_case("tiny_needs_weights", base="tiny_flipped", weights_from={"tensors": {"weight": ["model.w"]}}),
    tiny_case("tiny_gpu_only", base="tiny_flipped", devices=["gpu"]),
)


def planted_night(run_id, device="cpu", cases=()):
    return {"schema": 1, "kind": "nightly", "run_id": run_id, "device": device, "cases": list(cases)}


def write_night(folder, night):
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(night))
    return folder


@pytest.mark.parametrize("verdict, met, expected", [
    ("BITWISE_PASS", True, "pass"), ("DIFF", True, "pass"), ("DIFF", False, "fail"),
    ("UNSUPPORTED", False, "skip"), ("UNSUPPORTED", True, "pass"), ("ERROR", False, "fail")])
def test_outcome_follows_the_expectation(verdict, met, expected):
    result = CaseResult(run_id="r", case_name="c", device="cpu", verdict=verdict, expectation={"met": met})
    assert nightly.outcome(result) == expected


def test_find_previous_takes_the_newest_readable_night_of_the_same_device(tmp_path):
    write_night(tmp_path / "nightly-20260101-030000-aaaaaa", planted_night("n1"))
    write_night(tmp_path / "nightly-20260102-030000-bbbbbb", planted_night("n2"))
    write_night(tmp_path / "nightly-20260103-030000-cccccc", planted_night("n3", device="gpu"))
    (tmp_path / "nightly-20260104-030000-dddddd").mkdir()  # an interrupted night: no report.json
    write_night(tmp_path / "20260105-030000-some_case-eeeeee", planted_night("not a nightly folder"))
    assert nightly.find_previous(tmp_path, "cpu")["run_id"] == "n2"
    assert nightly.find_previous(tmp_path, "gpu")["run_id"] == "n3"
    assert nightly.find_previous(tmp_path / "missing", "cpu") is None


def test_a_bad_previous_report_or_registry_is_named_and_nothing_runs(tmp_path, capsys):
    case_report = write_night(tmp_path / "case-run", {"schema": 1, "case_name": "x"})
    reports = ["--reports", str(tmp_path / "reports")]
    assert main(["--cases", str(tmp_path), "nightly", *reports]) == nightly.EXIT_BAD_INPUT
    assert f"{tmp_path}: no case files" in capsys.readouterr().err
    write_cases(tmp_path, *TINY_CASES)
    code = main(["--cases", str(tmp_path / "cases"), "nightly", "--previous", str(case_report), *reports])
    assert code == nightly.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert str(case_report / "report.json") in err and "'kind'" in err
    assert not (tmp_path / "reports").exists()


def test_a_harness_crash_in_one_case_fails_that_case_and_keeps_the_night(tmp_path, monkeypatch):
    def fake_compare_case(name, options):  # test double: the harness itself breaks (disk full, a bug)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nightly.pipeline, "compare_case", fake_compare_case)
    monkeypatch.setenv("CI", "true")
    write_cases(tmp_path, *TINY_CASES)
    night, run_dir = nightly.run(CompareOptions(device="cpu", tokens=None, cases_dir=tmp_path / "cases",
                                 reports_dir=tmp_path / "reports", checkpoints_dir=tmp_path / "ckpt", pythons={},
                                 timeout=10, weights_file=None), previous=None)
    crashed, skipped = night["cases"]
    assert (crashed["outcome"], crashed["verdict"]) == ("fail", "ERROR")
    assert "No space left on device" in crashed["message"] and skipped["outcome"] == "skip"
    assert night["exit_code"] == 1 and night["trend"] == {"previous": None}
    assert "No space left on device" in (run_dir / "junit.xml").read_text()


def test_k_runs_only_the_cases_it_picks_and_an_empty_pick_is_an_error(tmp_path, monkeypatch, capsys):
    ran = []

    def fake_compare_case(name, options):  # test double: records which cases the night asked for, runs nothing
        ran.append(name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nightly.pipeline, "compare_case", fake_compare_case)
    write_cases(tmp_path, *TINY_CASES)
    options = CompareOptions(device="cpu", tokens=None, cases_dir=tmp_path / "cases", reports_dir=tmp_path / "reports",
                             checkpoints_dir=tmp_path / "ckpt", pythons={}, timeout=10, weights_file=None)
    night, run_dir = nightly.run(options, previous=None, expression="flipped and not weights")
    assert [e["case"] for e in night["cases"]] == ["tiny_flipped"] == ran
    assert night["select"] == "flipped and not weights"
    assert "`-k flipped and not weights` picks" in (run_dir / "report.md").read_text()
    code = main(["--cases", str(tmp_path / "cases"), "nightly", "-k", "no_such_case", "--reports", str(tmp_path / "r")])
    assert code == nightly.EXIT_BAD_INPUT and "-k 'no_such_case' picks none of the cpu cases" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.e2e
def test_nightly_over_a_tiny_registry(tmp_path, monkeypatch, capsys, checkpoints_dir):
    write_cases(tmp_path, *TINY_CASES)
    previous = write_night(tmp_path / "planted", planted_night("nightly-planted", cases=[
        {"case": "tiny_flipped", "outcome": "pass", "verdict": "BITWISE_PASS", "message": "",
         "result": {"tensors": [{"name": "out", "status": "EQUAL", "mismatches": 0, "max_ulp": 0}], "sides": []}},
        {"case": "tiny_retired", "outcome": "pass", "verdict": "BITWISE_PASS", "message": "", "result": None}]))
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("GITHUB_OUTPUT", raising=False)

    code = main(["--cases", str(tmp_path / "cases"), "nightly", "--previous", str(previous), "--tokens", "8",
                 "--reports", str(tmp_path / "reports"), "--checkpoints", str(checkpoints_dir)])

    out = capsys.readouterr().out
    assert code == 1, out
    assert "[nightly 1/2] tiny_flipped: running" in out and "[nightly 2/2] tiny_needs_weights: SKIP" in out
    (run_dir,) = (tmp_path / "reports").glob("nightly-*")
    assert {p.name for p in run_dir.iterdir()} == {"cases", "report.json", "report.md", "report.html", "junit.xml",
                                                   "doctor.json", "workers"}
    assert {p.name.split("-", 2)[2] for p in (run_dir / "workers").iterdir()} == {"megatron.log", "oracle.log"}
    doctor = json.loads((run_dir / "doctor.json").read_text())
    assert doctor["kind"] == "doctor" and list(doctor["runners"]) == ["megatron", "oracle"]  # what the night uses
    assert doctor["runners"]["megatron"]["ops"]["column_parallel_linear"]["would_run"]
    (case_dir,) = (run_dir / "cases").iterdir()
    assert (case_dir / "report.json").exists() and (case_dir / "a-megatron" / "outputs.safetensors").exists()

    night = json.loads((run_dir / "report.json").read_text())
    assert (night["schema"], night["kind"], night["device"], night["tokens"]) == (1, "nightly", "cpu", 8)
    assert night["summary"] == {"total": 2, "passed": 0, "failed": 1, "skipped": 1, "failed_by": {"unknown": 1}}
    flipped, weights = night["cases"]
    assert (flipped["outcome"], flipped["verdict"]) == ("fail", "DIFF"), flipped["message"]
    assert flipped["result"]["case"]["tokens"] == 8
    assert {t["name"]: t["status"] for t in flipped["result"]["tensors"]} == {
        "out": "DIFF", "grad.input": "EQUAL", "grad.weight": "DIFF"}
    assert (weights["outcome"], weights["verdict"], weights["result"]) == ("skip", None, None)

    t = night["trend"]
    assert [(c["case"], c["before"], c["after"]) for c in t["new_failures"]] == [
        ("tiny_flipped", "PASS (BITWISE_PASS)", "FAIL (DIFF)")]
    out_change = next(m for m in t["metric_changes"] if m["tensor"] == "out")
    assert out_change["mismatches"][0] == 0 and out_change["mismatches"][1] > 0
    assert [c["case"] for c in t["new_cases"]] == ["tiny_needs_weights"]
    assert [c["case"] for c in t["removed_cases"]] == ["tiny_retired"]
    assert any(p["field"] == "megatron versions.megatron-core" and p["before"] is None
               for p in t["provenance_changes"])

    markdown = (run_dir / "report.md").read_text()
    assert markdown.startswith("# Bitwise nightly on cpu: 1 failed, 0 passed, 1 skipped\n")
    assert markdown.index("## What changed since `nightly-planted`") < markdown.index("## Cases")
    assert "### New failures (1)" in markdown and "## Failures: differs, no baseline (1)" in markdown
    assert "expected BITWISE_PASS" not in markdown  # the case states no expectation: none is missed

    html = (run_dir / "report.html").read_text()
    assert "<h2>What changed since <code>nightly-planted</code></h2>" in html
    assert "<script" not in html and "<link" not in html  # self-contained

    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "1", "1")
    flipped_case, weights_case = suite.findall("testcase")
    failure = flipped_case.find("failure")
    assert flipped_case.get("name") == "tiny_flipped" and failure.get("type") == "DIFF"
    assert failure.text.startswith("differs, no baseline: DIFF: ") and "expected BITWISE_PASS" not in failure.text
    assert "--weights FILE" in weights_case.find("skipped").get("message")
