"""Known verdicts (baselines): a nightly is green unless something changed.

The nights here run the real pipeline (registry, checkpoints, orchestration, comparator, oracle, reports) with
two runner test doubles, named as such (``fake_megatron_python``, ``fake_paddle_python``): both compute the
linear op exactly in float32 numpy from the checkpoint they are given, and the Paddle double then flips the
bits a control file names for a case (a "platform" difference, or one planted bit), or crashes for a case the
file names. They test the harness's own logic and never produce a reported verdict of a real comparison.
The last test runs the real Megatron-Core runner twice on a tiny fp32 case.
"""

import copy
import json
import sys
import xml.etree.ElementTree as ET

import pytest

from harness.cli import main
from harness.compare import baseline
from tests.support.cases import tiny_case, write_cases
from tests.support.doubles import fake_interpreter

FAKE_RUNNER = """\
#!{python}
import json, pathlib, sys
import numpy as np
from safetensors.numpy import load_file, save_file
request = json.loads(pathlib.Path(sys.argv[sys.argv.index("--request") + 1]).read_text())
role = {role!r}
plan = json.loads(pathlib.Path({control!r}).read_text()).get(request["case"], {{}})
if role == "paddle" and plan.get("crash"):
    sys.exit("fake paddle runner: planted crash")
inputs = load_file(request["checkpoint"])
x, w, dy = inputs["input"], inputs["weight"], inputs["grad_output"]
tensors = {{"out": x @ w.T, "grad.input": dy @ w, "grad.weight": dy.T @ x}}
tensors = {{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}}
if role == "paddle":
    for name, index, bit in plan.get("flips", []):
        tensors[name].view(np.uint32)[tuple(index)] ^= np.uint32(1 << bit)
folder = pathlib.Path(request["output_dir"])
save_file(tensors, str(folder / "outputs.safetensors"))
(folder / "meta.json").write_text(json.dumps({{
    "runner": role, "framework": "fake-" + role, "versions": {{"fake-" + role: {version!r}}},
    "env": {{"ONEDNN_MAX_CPU_ISA": "AVX2", "HARNESS_PYTHON_X": "/somewhere/python"}}}}))
"""

# A "platform" difference: three elements of `out` that this fake Paddle computes differently on every night.
PLATFORM_DIFF = [["out", [0, 0], 0], ["out", [1, 2], 1], ["out", [3, 3], 2]]

CASES = (
    tiny_case("known_diff", description="DIFF for a platform reason every night"),
    tiny_case("agrees"),
    tiny_case("control", runners=["megatron", "megatron"],
              perturb={"side": "b", "tensor": "input", "index": [1, 2], "bit": 3},
              expect={"verdict": "DIFF", "differs": ["out", "grad.weight"], "equal": ["grad.input"]}),
)


@pytest.fixture
def bench(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("GITHUB_OUTPUT", raising=False)
    return Bench(tmp_path)


class Bench:
    """A tiny registry, the two doubles, their control file, and folders for reports and baselines."""

    def __init__(self, root, version="1.0"):
        self.root = root
        self.cases = write_cases(root, *CASES)
        self.control = root / "control.json"
        self.plan({"known_diff": {"flips": PLATFORM_DIFF}})
        self.baselines = root / "baselines"
        self.set_version(version)

    def set_version(self, version):
        self.pythons = [f"{role}={fake_interpreter(self.root, f'fake_{role}_python', self._body(role, version))}"
                        for role in ("megatron", "paddle")]

    def _body(self, role, version):
        return FAKE_RUNNER.format(python=sys.executable, role=role, control=str(self.control), version=version)

    def plan(self, plan):
        self.control.write_text(json.dumps(plan))

    def night(self, capsys, cases=None, *extra):
        args = ["--cases", str(cases or self.cases), "nightly", "--reports", str(self.root / "reports"),
                "--checkpoints", str(self.root / "ck"), "--baselines", str(self.baselines), "--timeout", "60",
                "--fresh-process"]  # the doubles serve one request per process (no --worker)
        for item in self.pythons:
            args += ["--python", item]
        before = set((self.root / "reports").glob("nightly-*"))
        code = main(args + list(extra))
        out = capsys.readouterr().out
        (run_dir,) = set((self.root / "reports").glob("nightly-*")) - before
        return code, json.loads((run_dir / "report.json").read_text()), run_dir, out

    def update(self, capsys, night_dir=None, *extra):
        args = ["baseline", "update", "--reports", str(self.root / "reports"), "--baselines", str(self.baselines)]
        code = main(args + (["--from", str(night_dir)] if night_dir else []) + list(extra))
        captured = capsys.readouterr()
        return code, captured.out, captured.err


def by_case(night):
    return {entry["case"]: entry for entry in night["cases"]}


def test_green_after_update_then_one_flipped_bit_turns_exactly_that_case_red(bench, capsys):
    code, night, run_dir, out = bench.night(capsys)
    assert code == 1, out  # no baseline for this platform: judged by each case's own expectation, as before
    assert night["baseline"]["status"] == "none" and "baseline: none for this platform" in out
    assert {c: e["outcome"] for c, e in by_case(night).items()} == {
        "known_diff": "fail", "agrees": "pass", "control": "pass"}
    assert "No baseline for this platform" in (run_dir / "report.md").read_text()

    code, out, err = bench.update(capsys)  # no --from: the newest night
    assert code == 0, err
    (written,) = bench.baselines.glob("*.json")
    assert written.name.startswith("cpu-") and written.name.endswith(f"{night['baseline']['fingerprint_id'][:8]}.json")
    assert "+ known_diff: added: DIFF (expected BITWISE_PASS): out 3 mismatches" in out
    assert f"wrote {written}" in out
    stored = json.loads(written.read_text())
    assert stored["fingerprint"] == night["baseline"]["fingerprint"]
    assert stored["cases"]["known_diff"]["differing"] == {"out": {"status": "DIFF", "mismatches": 3, "max_ulp": 4}}
    assert stored["cases"]["agrees"]["differing"] == {}

    code, night, run_dir, out = bench.night(capsys)
    assert code == 0, out  # the same machine, the same bits: green
    assert night["summary"] == {"total": 3, "passed": 3, "failed": 0, "skipped": 0}
    section = night["baseline"]
    assert section["status"] == "applied" and section["file"] == str(written)
    assert section["counts"]["match"] == 3
    assert "(known: matches the baseline)" in by_case(night)["known_diff"]["message"]
    markdown = (run_dir / "report.md").read_text()
    assert "## Known verdicts (baseline)" in markdown and "3 match" in markdown
    assert bench.update(capsys)[1].endswith("no change to the known verdicts: file left as it is\n")

    # One flipped bit in one output of one case, planted by the fake Paddle runner; the platform diff stays.
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF}, "agrees": {"flips": [["grad.weight", [2, 5], 0]]}})
    code, night, run_dir, out = bench.night(capsys)
    assert code == 1
    assert {c: (e["outcome"], e["baseline"]) for c, e in by_case(night).items()} == {
        "known_diff": ("pass", "match"), "agrees": ("fail", "changed"), "control": ("pass", "match")}
    problems = by_case(night)["agrees"]["problems"]
    assert "differs from the baseline: verdict BITWISE_PASS → DIFF" in problems
    assert "differs from the baseline: grad.weight: new difference (1 mismatches, max ULP 1)" in problems
    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    failed = [(c.get("name"), c.find("failure").text) for c in suite.findall("testcase")
              if c.find("failure") is not None]
    assert len(failed) == 1 and failed[0][0] == "agrees" and "grad.weight: new difference" in failed[0][1]
    markdown = (run_dir / "report.md").read_text()
    assert "### Changed against the baseline (fail): 1" in markdown
    assert "`agrees` BITWISE_PASS → **DIFF**: verdict BITWISE_PASS → DIFF; grad.weight: new difference" in markdown


def test_fixed_and_new_cases_pass_and_are_listed_and_update_prints_the_diff(bench, capsys):
    bench.night(capsys)
    assert bench.update(capsys)[0] == 0
    cases = write_cases(bench.root / "more", *CASES, tiny_case("newcomer", seed=11))
    # known_diff computes right now (fixed); newcomer differs for a platform reason but has no baseline (new).
    bench.plan({"newcomer": {"flips": [["out", [0, 1], 0]]}})
    code, night, run_dir, out = bench.night(capsys, cases)
    assert code == 0, out
    judged = {c: (e["outcome"], e["baseline"]) for c, e in by_case(night).items()}
    assert judged == {"known_diff": ("pass", "fixed"), "agrees": ("pass", "match"), "control": ("pass", "match"),
                      "newcomer": ("pass", "new")}
    assert "(new: no baseline for this case yet)" in by_case(night)["newcomer"]["message"]
    markdown = (run_dir / "report.md").read_text()
    assert "### Fixed (now meets its expectation): 1" in markdown
    assert "`known_diff` DIFF → **BITWISE_PASS**: verdict DIFF → BITWISE_PASS" in markdown
    assert "### New (no baseline record: not failed): 1" in markdown and "`newcomer` — → **DIFF**" in markdown

    code, out, _ = bench.update(capsys, run_dir, "--dry-run")
    assert code == 0 and "dry run: nothing written" in out
    assert ("~ known_diff: changed\n    verdict DIFF → BITWISE_PASS\n"
            "    out: now bitwise equal (baseline: 3 mismatches") in out
    assert "+ newcomer: added: DIFF (expected BITWISE_PASS): out 1 mismatches, max ULP 1" in out
    assert "2 case(s) unchanged; 4 in the baseline" in out


def test_update_refuses_a_night_with_an_error_and_names_the_cases(bench, capsys):
    bench.plan({"agrees": {"crash": True}})
    code, night, run_dir, _ = bench.night(capsys)
    assert code == 1 and by_case(night)["agrees"]["verdict"] == "ERROR"
    code, out, err = bench.update(capsys, run_dir)
    assert code == 1 and "refused" in err and "1 case(s) ended ERROR: agrees" in err
    assert not bench.baselines.exists()


def test_a_broken_baseline_file_is_named_and_nothing_runs(bench, capsys):
    bench.baselines.mkdir()
    (bench.baselines / "broken.json").write_text("{not json")
    args = ["--cases", str(bench.cases), "nightly", "--reports", str(bench.root / "reports"),
            "--baselines", str(bench.baselines)]
    assert main(args) == 2
    assert f"{bench.baselines / 'broken.json'}: cannot read a baseline" in capsys.readouterr().err
    assert not (bench.root / "reports").exists()


# --- fingerprint and records on planted data (no runs) --------------------------------------------------------

def planted(meta_b=None, label_b="b"):
    meta = {"framework": "megatron-core", "versions": {"torch": "2.13.0", "megatron-core": "0.19.2"},
            "torch_threads": 2, "cublas": "12.8.4 (/opt/envs/a/lib/libcublas.so.12)", "implementation": "per case",
            "env": {"ONEDNN_MAX_CPU_ISA": "AVX2", "HARNESS_PYTHON_MEGATRON": "/opt/envs/a/bin/python"}}
    sides = [{"label": "a", "runner": "megatron", "meta": meta},
             {"label": label_b, "runner": "paddle", "meta": meta_b or {"versions": {"paddlepaddle": "3.3.1"}}},
             {"label": "oracle", "runner": "oracle", "meta": {"versions": {"numpy": "2.3"}}}]
    return {"device": "cpu", "harness": {"host": {"machine": "x86_64", "cpu": "AMD EPYC 9B14 96-Core Processor",
                                                  "cpu_isa": ["avx2", "avx512_bf16", "avx512f"],
                                                  "logical_cpus": 2, "system": "Linux-6.1"}},
            "cases": [{"case": "c", "verdict": "DIFF", "result": {"sides": sides}}]}


def test_fingerprint_keeps_what_decides_bits_and_drops_paths_noise_and_the_oracle():
    print_ = baseline.fingerprint(planted())
    assert print_["platform"] == {"device": "cpu", "machine": "x86_64", "cpu": "AMD EPYC 9B14 96-Core Processor",
                                  "cpu_isa": "avx2 avx512_bf16 avx512f"}
    assert print_["runners"]["megatron"] == {
        "cublas": "12.8.4", "env.ONEDNN_MAX_CPU_ISA": "AVX2", "framework": "megatron-core", "torch_threads": "2",
        "versions.megatron-core": "0.19.2", "versions.torch": "2.13.0"}
    assert set(print_["runners"]) == {"megatron", "paddle"}
    assert baseline.file_name(print_) == (f"cpu-amd-epyc-9b14-96-core-avx512bf16-megatron-core0.19.2-"
                                          f"paddlepaddle3.3.1-torch2.13.0-{baseline.fingerprint_id(print_)[:8]}.json")
    moved = planted()
    moved["cases"][0]["result"]["sides"][0]["meta"]["cublas"] = "12.8.4 (/elsewhere/libcublas.so.12)"
    moved["harness"]["host"]["logical_cpus"] = 64
    assert baseline.fingerprint_id(baseline.fingerprint(moved)) == baseline.fingerprint_id(print_)
    upgraded = planted(meta_b={"versions": {"paddlepaddle": "3.4.0"}})
    assert baseline.differences(print_, baseline.fingerprint(upgraded)) == [
        {"field": "runners.paddle.versions.paddlepaddle", "baseline": "3.3.1", "tonight": "3.4.0"}]


def test_another_platform_is_judged_as_before_and_the_nearest_baseline_says_why(tmp_path):
    night = planted()
    night["cases"][0].update({"outcome": "fail", "exit_code": 1, "expected": "BITWISE_PASS"})
    recorded, changes = baseline.build(night, None)
    assert changes == [{"case": "c", "change": "added", "details": ["DIFF (expected BITWISE_PASS)"]}]
    (tmp_path / "x.json").write_text(baseline.dumps(recorded))
    known = baseline.load_all(tmp_path)
    assert baseline.apply(copy.deepcopy(night), known)["counts"]["match"] == 1
    upgraded = planted(meta_b={"versions": {"paddlepaddle": "3.4.0"}})
    upgraded["cases"][0].update({"outcome": "fail", "exit_code": 1})
    section = baseline.apply(upgraded, known)
    assert section["status"] == "none" and upgraded["cases"][0]["outcome"] == "fail"
    assert section["nearest"] == {"file": str(tmp_path / "x.json"), "differences": [
        {"field": "runners.paddle.versions.paddlepaddle", "baseline": "3.3.1", "tonight": "3.4.0"}]}


def test_what_matches_means():
    known = {"verdict": "DIFF", "expected": "BITWISE_PASS", "expectation_met": False,
             "definition": {"tokens": 16, "checkpoint_digest": "abc"},
             "differing": {"out": {"status": "DIFF", "mismatches": 3, "max_ulp": 4}}}

    def entry(verdict="DIFF", exit_code=1, outcome="fail", tensors=(("out", 3, 4),), tokens=16):
        return {"case": "c", "verdict": verdict, "exit_code": exit_code, "outcome": outcome, "expected": "BITWISE_PASS",
                "result": {"case": {"tokens": tokens}, "checkpoint": {"digest": "abc"},
                           "tensors": [{"name": n, "status": "DIFF", "mismatches": m, "max_ulp": u}
                                       for n, m, u in tensors] + [{"name": "grad.input", "status": "EQUAL"}]}}

    def judged(e, k=known):
        return (lambda j: (j["status"], j["outcome"], j["changes"]))(baseline.judge_case(e, k))

    assert judged(entry()) == ("match", "pass", [])
    assert judged(entry(tensors=(("out", 3, 5),))) == ("changed", "fail", ["out: max ulp 4 → 5"])
    assert judged(entry(tensors=(("out", 2, 4),)))[:2] == ("changed", "fail")  # better, but not what it expects
    assert judged(entry(tensors=(("out", 3, 4), ("grad.weight", 1, 1))))[2] == [
        "grad.weight: new difference (1 mismatches, max ULP 1)"]
    assert judged(entry("BITWISE_PASS", 0, "pass", ()))[:2] == ("fixed", "pass")
    assert judged(entry("ERROR", 2, "fail", ())) == ("changed", "fail", ["verdict DIFF → ERROR"])
    crashed = {"case": "c", "verdict": "ERROR", "exit_code": 2, "outcome": "fail", "result": None}  # harness crash
    assert judged(crashed) == ("changed", "fail", ["verdict DIFF → ERROR"])
    assert judged(entry(tokens=60))[:2] == ("new", "pass")
    assert judged(entry(tokens=60))[2][0].startswith("definition changed (tokens: 16 → 60)")
    assert judged(entry(), None)[:2] == ("new", "pass")
    assert judged(entry("ERROR", 2, "fail", ()), None)[:2] == ("new", "fail")
    assert judged(entry("UNSUPPORTED", 3, "skip", ()), None)[:2] == ("new", "skip")
    control = copy.deepcopy(known) | {"verdict": "DIFF", "expectation_met": True}
    assert judged(entry(exit_code=0, outcome="pass", tensors=(("out", 5, 4),)), control)[:2] == ("expected", "pass")
    unsupported = copy.deepcopy(known) | {"verdict": "UNSUPPORTED", "differing": {}}
    assert judged(entry("UNSUPPORTED", 3, "skip", ()), unsupported)[:2] == ("match", "skip")
    assert judged(entry(), unsupported) == ("changed", "fail", ["verdict UNSUPPORTED → DIFF"])
    assert baseline.judge_case({"case": "c", "verdict": None, "outcome": "skip"}, known)["status"] == "not run"


@pytest.mark.e2e
def test_real_megatron_night_is_green_the_second_time(tmp_path, monkeypatch, capsys, checkpoints_dir):
    """Megatron vs Megatron, fp32 64x32, one input bit flipped on side b in a case that expects bitwise equality."""
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("GITHUB_OUTPUT", raising=False)
    cases = write_cases(tmp_path, tiny_case("tiny_flipped", seed=7, tokens=8, shapes={"input_size": 64,
                                            "output_size": 32}, runners=["megatron", "megatron"], devices=["cpu"],
                                            perturb={"side": "b", "tensor": "input", "index": [3, 5], "bit": 6}))
    args = ["--cases", str(cases), "nightly", "--reports", str(tmp_path / "reports"), "--checkpoints",
            str(checkpoints_dir), "--baselines", str(tmp_path / "baselines")]
    assert main(args) == 1
    assert main(["baseline", "update", "--reports", str(tmp_path / "reports"),
                 "--baselines", str(tmp_path / "baselines")]) == 0
    (written,) = (tmp_path / "baselines").glob("*.json")
    stored = json.loads(written.read_text())
    assert stored["fingerprint"]["runners"]["megatron"]["framework"] == "megatron-core"
    assert set(stored["cases"]["tiny_flipped"]["differing"]) == {"out", "grad.weight"}
    capsys.readouterr()
    assert main(args) == 0
    assert f"baseline {written}: 1 match" in capsys.readouterr().out
    (second,) = sorted((tmp_path / "reports").glob("nightly-*"))[1:]
    night = json.loads((second / "report.json").read_text())
    assert night["cases"][0]["baseline"] == "match" and night["exit_code"] == 0
