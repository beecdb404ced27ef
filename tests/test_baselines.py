"""Known verdicts (baselines): a known platform difference passes, and nothing turns a failure green.

The nights here run the real pipeline (registry, checkpoints, orchestration, comparator, oracle, reports) with
two runner test doubles, named as such (``fake_megatron_python``, ``fake_paddle_python``), and a stand-in for the
night's doctor probe (not under test here): both runner doubles compute the
linear op exactly in float32 numpy from the checkpoint they are given, and the Paddle double then flips the
bits a control file names for a case (a "platform" difference, or one planted bit), says UNSUPPORTED with a
reason the file gives, or crashes. They test the harness's own logic and never produce a reported verdict of a
real comparison. The last test runs the real Megatron-Core runner twice on a tiny fp32 case.
"""

import copy
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from safetensors.numpy import save_file

from harness.baselines import records, store
from harness.case.registry import Registry
from harness.cli import main
from harness.commands import nightly
from harness.run.protocol import host_provenance
from tests.support.baseline_bench import CASES, PLATFORM_DIFF, Bench, by_case
from tests.support.cases import registry_from, tiny_case, write_cases


@pytest.fixture
def no_doctor(monkeypatch):
    """Test double: the night's doctor.json (it probes each runner the night uses: Megatron's probe alone imports torch
    and megatron-core, seconds) is not under test here (tests/test_doctor.py and tests/test_nightly.py test it)."""
    monkeypatch.setattr(nightly.doctor, "run", lambda device, pythons, runners: {"kind": "doctor", "test_double": True})


@pytest.fixture
def bench(tmp_path, monkeypatch, no_doctor):
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("GITHUB_OUTPUT", raising=False)
    return Bench(tmp_path)


def test_green_after_update_then_one_flipped_bit_turns_exactly_that_case_red(bench, capsys):
    code, night, run_dir, out = bench.night(capsys)
    assert code == 1, out  # no baseline for this platform: judged by each case's own expectation
    [part] = night["baseline"]["platforms"]
    assert night["baseline"]["status"] == "none" and part["file"] is None and "baseline: none for cpu" in out
    assert {c: e["outcome"] for c, e in by_case(night).items()} == {
        "known_diff": "fail", "agrees": "pass", "control": "pass"}
    markdown = (run_dir / "report.md").read_text()
    assert "**no baseline for this platform** (3 cases)" in markdown

    code, out, err = bench.update(capsys)  # no --from: the newest night
    assert code == 0, err
    (written,) = bench.baselines.glob("*.json")
    assert written.name == records.file_name(part["platform"]) and written.name.startswith("cpu-")
    assert "+ known_diff: added: DIFF: out 3 mismatches" in out
    assert f"wrote {written}" in out
    stored = json.loads(written.read_text())
    assert stored["platform"] == part["platform"] == records.platform(host_provenance(), "cpu")
    out_record = stored["cases"]["known_diff"]["differing"]["out"]
    assert {k: v for k, v in out_record.items() if k != "bits"} == {"status": "DIFF", "mismatches": 3, "max_ulp": 4}
    assert stored["cases"]["known_diff"]["runners"] == ["megatron", "paddle"]
    assert stored["runners"]["paddle"] == {"env.ONEDNN_MAX_CPU_ISA": "AVX2", "framework": "fake-paddle",
                                           "versions.fake-paddle": "1.0"}  # no logging switch, no path
    assert stored["cases"]["agrees"]["differing"] == {}

    code, night, run_dir, out = bench.night(capsys)
    assert code == 0, out  # the same machine, the same bits: green
    assert night["summary"] == {"total": 3, "passed": 3, "failed": 0, "skipped": 0, "failed_by": {}}
    section = night["baseline"]
    assert section["status"] == "applied" and section["platforms"][0]["file"] == str(written)
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
    assert night["summary"]["failed_by"] == {"changed": 1} and "failed: 1 changed against the baseline" in out
    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    failed = [(c.get("name"), c.find("failure").text) for c in suite.findall("testcase")
              if c.find("failure") is not None]
    assert len(failed) == 1 and failed[0][0] == "agrees" and "grad.weight: new difference" in failed[0][1]
    assert failed[0][1].startswith("changed against the baseline: DIFF")
    markdown = (run_dir / "report.md").read_text()
    assert "### Changed against the baseline (fail): 1" in markdown
    assert "`agrees` BITWISE_PASS → **DIFF**: verdict BITWISE_PASS → DIFF; grad.weight: new difference" in markdown


def test_a_difference_nothing_states_fails_apart_and_says_how_to_accept_it(bench, capsys):
    """No baseline for the platform: the known difference fails as "differs, no baseline", apart from an ERROR,
    with the command that accepts it. (Before: one undivided list of failures.)"""
    cases = write_cases(bench.root / "more", *CASES, tiny_case("crashes", seed=5))
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF}, "crashes": {"crash": True}})
    code, night, run_dir, out = bench.night(capsys, cases)
    assert code == 1
    assert {c: e["failure"] for c, e in by_case(night).items()} == {
        "known_diff": "unknown", "agrees": None, "control": None, "crashes": "error"}
    assert night["summary"]["failed_by"] == {"error": 1, "unknown": 1}
    assert "failed: 1 ERROR, 1 differs, no baseline" in out
    assert f"accept the differences no baseline states (if right): python -m harness baseline update --from {run_dir}" \
        in out
    markdown = (run_dir / "report.md").read_text()
    assert "Failed: 1 ERROR, 1 differs, no baseline." in markdown
    assert markdown.index("## Failures: ERROR (1)") < markdown.index("## Failures: differs, no baseline (1)")
    assert f"`python -m harness baseline update --from reports/{night['run_id']}`" in markdown


def test_a_fixed_case_fails_until_recorded_and_a_new_case_is_judged_by_its_own_expectation(bench, capsys):
    """A case the baseline has no record of never passes by itself: before, any verdict of it but ERROR passed. A case
    that now meets its expectation where its record did not is news that fails the night until someone looks and
    records it again (before: it passed, so a night could turn green with nobody looking)."""
    bench.recorded(capsys)
    cases = write_cases(bench.root / "more", *CASES, tiny_case("newcomer", seed=11))
    # known_diff computes right now (fixed); newcomer differs for a platform reason but has no record (new).
    bench.plan({"newcomer": {"flips": [["out", [0, 1], 0]]}})
    code, night, run_dir, out = bench.night(capsys, cases)
    assert code == 1, out
    judged = {c: (e["outcome"], e["baseline"], e["failure"]) for c, e in by_case(night).items()}
    assert judged == {"known_diff": ("fail", "fixed", "changed"), "agrees": ("pass", "match", None),
                      "control": ("pass", "match", None), "newcomer": ("fail", "new", "unknown")}
    markdown = (run_dir / "report.md").read_text()
    assert "### Now meets its expectation, which the record did not (fail: look, then record it again): 1" in markdown
    assert "`known_diff` DIFF → **BITWISE_PASS**: it now meets its expectation" in markdown
    assert "verdict DIFF → BITWISE_PASS" in markdown
    assert "### No record of the case (judged by its own expectation): 1" in markdown

    code, out, _ = bench.update(capsys, run_dir, "--dry-run")
    assert code == 0 and "dry run: nothing written" in out
    assert ("~ known_diff: changed\n    verdict DIFF → BITWISE_PASS\n"
            "    out: now bitwise equal (baseline: 3 mismatches") in out
    assert "+ newcomer: added: DIFF: out 1 mismatches, max ULP 1" in out
    assert "2 case(s) unchanged; 4 in the baseline" in out


@pytest.mark.slow  # 17 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_a_changed_definition_is_judged_by_its_own_expectation(bench, capsys):
    """`nightly --tokens 8` against a 4-token baseline: the known difference is no longer known (before: "new",
    and passed whatever it gave)."""
    bench.recorded(capsys)
    code, night, run_dir, out = bench.night(capsys, None, "--tokens", "8")
    assert code == 1, out
    known = by_case(night)["known_diff"]
    assert (known["outcome"], known["baseline"], known["failure"]) == ("fail", "redefined", "unknown")
    assert any("the baseline's record does not apply: definition changed:" in p and "tokens: 4 → 8" in p
               for p in known["problems"]), known["problems"]
    assert by_case(night)["agrees"]["outcome"] == "pass"  # bitwise, as it expects: no record needed


@pytest.mark.slow  # 27 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_unsupported_matches_only_with_the_same_reason(bench, capsys):
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF},
                "agrees": {"unsupported": "kernel `matmul` (CPU, bfloat16) not registered, pid 4242 (/opt/x/lib.so)"}})
    bench.recorded(capsys)
    stored = json.loads(next(bench.baselines.glob("*.json")).read_text())["cases"]["agrees"]
    assert stored["reason"] == "paddle: kernel `matmul` (CPU, bfloat16) not registered, pid <pid> (<path>)"
    elsewhere = "kernel `matmul` (CPU, bfloat16) not registered, pid 77 (/elsewhere/lib.so)"
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF}, "agrees": {"unsupported": elsewhere}})
    code, night, _, out = bench.night(capsys)
    assert code == 0 and by_case(night)["agrees"]["baseline"] == "match", out  # paths and pids do not count
    assert by_case(night)["agrees"]["outcome"] == "skip"
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF}, "agrees": {"unsupported": "No module named 'paddle'"}})
    code, night, _, out = bench.night(capsys)
    agrees = by_case(night)["agrees"]
    assert code == 1 and (agrees["outcome"], agrees["baseline"]) == ("fail", "changed"), out
    assert any("another reason: paddle: kernel `matmul`" in p for p in agrees["problems"]), agrees["problems"]


@pytest.mark.slow  # 15 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_a_broken_install_fails_the_cases_the_baseline_ran(bench, capsys):
    """The Paddle side cannot import and writes no versions: before, its fingerprint changed, no baseline applied,
    every case skipped as UNSUPPORTED and the night exited 0."""
    bench.recorded(capsys)
    broken = {"unsupported": "paddle is not importable: libpaddle.so: cannot open shared object", "broken": True}
    bench.plan({"known_diff": broken, "agrees": broken})
    code, night, run_dir, out = bench.night(capsys)
    assert code == 1, out
    assert {c: (e["outcome"], e["baseline"], e["failure"]) for c, e in by_case(night).items()} == {
        "known_diff": ("fail", "lost", "lost"), "agrees": ("fail", "lost", "lost"), "control": ("pass", "match", None)}
    assert any("the baseline ran it (DIFF); tonight UNSUPPORTED: paddle: paddle is not importable" in p
               for p in by_case(night)["known_diff"]["problems"])
    assert "### Ran in the baseline, UNSUPPORTED or not run tonight (fail): 2" in (run_dir / "report.md").read_text()


@pytest.mark.slow  # 17 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_a_case_the_baseline_ran_and_tonight_did_not_run_fails(bench, capsys):
    weights = bench.root / "w.safetensors"
    save_file({"model.w": np.full((4, 8), 0.5, np.float32)}, str(weights))
    imported = tiny_case("imported", weights_from={"tensors": {"weight": ["model.w"]}})
    cases = write_cases(bench.root / "w", *CASES, imported)
    bench.night(capsys, cases, "--weights", str(weights))
    assert bench.update(capsys)[0] == 0
    code, night, _, out = bench.night(capsys, cases)  # no --weights tonight
    imported = by_case(night)["imported"]
    assert code == 1 and (imported["outcome"], imported["baseline"]) == ("fail", "lost"), out
    assert "tonight it did not run: not run: takes its weights from a file (--weights FILE)" in imported["problems"][0]


def test_a_changed_runner_is_named_on_each_case_and_fails_only_what_needed_the_record(bench, capsys):
    bench.recorded(capsys)
    bench.set_version("2.0")  # both doubles report another version of themselves, same bits
    code, night, run_dir, out = bench.night(capsys)
    assert code == 1, out
    judged = {c: (e["outcome"], e["baseline"]) for c, e in by_case(night).items()}
    assert judged == {"known_diff": ("fail", "runner changed"), "agrees": ("pass", "runner changed"),
                      "control": ("pass", "runner changed")}
    problems = by_case(night)["known_diff"]["problems"]
    assert ("the baseline's record does not apply: side b (paddle) versions.fake-paddle: 1.0 → 2.0" in problems
            and "the baseline's record does not apply: tonight's numbers equal the record's" in problems), problems
    code, out, _ = bench.update(capsys, run_dir)
    assert code == 0 and "~ runners.paddle.versions.fake-paddle: 1.0 → 2.0" in out and "wrote" in out


@pytest.mark.slow  # two shards' nights and their merge: 30 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_shards_are_judged_together_after_the_merge(bench, capsys):
    """Each shard alone judges nothing and exits 0; the merge applies the baseline to the whole night (before: each
    shard applied it alone, and the merge never did, so a known difference failed the merged night)."""
    written = bench.recorded(capsys)
    shard_dirs = []
    for index in (1, 2):
        code, night, run_dir, out = bench.night(capsys, None, "--shard", f"{index}/2", reports=f"shard{index}")
        assert code == 0 and "baseline" not in night, out
        assert "shard: not judged alone" in out
        shard_dirs.append(run_dir)
    code = main(["nightly-merge", *map(str, shard_dirs), "--reports", str(bench.root / "merged"),
                 "--baselines", str(bench.baselines)])
    (merged_dir,) = (bench.root / "merged").glob("nightly-*")
    merged = json.loads((merged_dir / "report.json").read_text())
    assert code == 0 and merged["baseline"]["platforms"][0]["file"] == str(written)
    assert {c: e["baseline"] for c, e in by_case(merged).items()} == {
        "known_diff": "match", "agrees": "match", "control": "match"}
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF[:1]}})
    shard = bench.night(capsys, None, "--shard", "1/2", reports="shard3")[2]
    assert main(["nightly-merge", str(shard), "--reports", str(bench.root / "merged2"),
                 "--baselines", str(bench.baselines)]) == 1  # one shard missing, and known_diff moved


@pytest.mark.slow  # 16 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_a_night_of_a_few_cases_updates_only_their_records(bench, capsys):
    """`nightly -k` then `baseline update`: the picked cases' records move, the others stay as they were (before,
    the update removed every case the night had not run); a pick at another token count is refused."""
    written = bench.recorded(capsys)
    before = json.loads(written.read_text())
    bench.plan({"known_diff": {"flips": PLATFORM_DIFF[:1]}})
    code, night, run_dir, _ = bench.night(capsys, None, "-k", "known_diff")
    assert code == 1 and [e["case"] for e in night["cases"]] == ["known_diff"]
    code, out, _ = bench.update(capsys, run_dir)
    after = json.loads(written.read_text())
    assert code == 0 and "removed" not in out and set(after["cases"]) == set(before["cases"])
    assert after["cases"]["known_diff"] != before["cases"]["known_diff"]
    assert {k: v for k, v in after["cases"].items() if k != "known_diff"} == \
        {k: v for k, v in before["cases"].items() if k != "known_diff"}
    assert after["recorded_from"]["updated_from"][0]["select"] == "known_diff"
    run_dir = bench.night(capsys, None, "-k", "known_diff", "--tokens", "3")[2]
    code, _, err = bench.update(capsys, run_dir)
    assert code != 0 and "one baseline holds one token count" in err and json.loads(written.read_text()) == after


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


# --- platform, runner fields and records on planted data (no runs) -------------------------------------------

HOST = {"machine": "x86_64", "cpu": "AMD EPYC 9B14 96-Core Processor", "cpu_isa": ["avx2", "avx512_bf16", "avx512f"],
        "logical_cpus": 2, "system": "Linux-6.1"}


def test_the_platform_chooses_the_baseline_and_the_runner_fields_hold_only_what_changes_bits():
    assert records.platform(HOST, "cpu") == {"device": "cpu", "machine": "x86_64",
                                              "cpu": "AMD EPYC 9B14 96-Core Processor",
                                              "cpu_isa": "avx2 avx512_bf16 avx512f"}
    assert records.platform({**HOST, "logical_cpus": 64, "system": "Linux-6.8"}, "cpu") == \
        records.platform(HOST, "cpu")  # core count and kernel version do not pick kernels
    sides = [{"label": "a", "meta": {"gpu": "NVIDIA H200"}}]
    assert records.platform(HOST, "gpu", sides) == {"device": "gpu", "gpu": "NVIDIA H200"}
    assert records.file_name(records.platform(HOST, "cpu")).startswith("cpu-amd-epyc-9b14-96-core-avx512bf16-")
    meta = {"framework": "megatron-core", "versions": {"megatron-core": "0.19.2"}, "torch": "2.13.0",
            "torch_threads": 2, "cublas": "12.8.4 (/opt/envs/a/lib/libcublas.so.12)", "implementation": "per case",
            "phases": {"forward": 0.1}, "process": {"pid": 12}, "host": HOST,
            "env": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "1",
                    "HARNESS_PYTHON_MEGATRON": "/opt/envs/a/bin/python", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x",
                    "TORCHDYNAMO_DISABLE": "1"}}
    assert records.runner_fields(meta) == {
        "cublas": "12.8.4", "env.OMP_NUM_THREADS": "2", "env.ONEDNN_MAX_CPU_ISA": "AVX2",
        "env.TORCHDYNAMO_DISABLE": "1", "framework": "megatron-core", "torch": "2.13.0", "torch_threads": "2",
        "versions.megatron-core": "0.19.2"}
    assert all(records.is_runner_field(key) for key in records.runner_fields(meta))
    assert not any(records.is_runner_field(key) for key in ("env.ONEDNN_VERBOSE", "implementation", "host.cpu"))


def test_unsupported_reasons_are_normalised():
    assert records.normalise_reason("megatron.core is not importable by /home/u/.venv/bin/python: No module named "
                                     "'megatron' (pid 1234, at 0x7f00deadbeef)") == \
        "megatron.core is not importable by <path>: No module named 'megatron' (pid <pid>, at <address>)"


def test_what_matches_means():
    known = {"verdict": "DIFF", "definition": {"tokens": 16, "runners": ["m", "p"], "checkpoint_digest": "abc"},
             "differing": {"out": {"status": "DIFF", "mismatches": 3, "max_ulp": 4}}, "runners": ["m", "p"]}
    table = {"platform": {}, "runners": {"m": {"framework": "m"}, "p": {"framework": "p"}}}

    def entry(verdict="DIFF", exit_code=1, outcome="fail", tensors=(("out", 3, 4),), tokens=16, message="", p="p"):
        sides = [{"label": "a", "runner": "m", "meta": {"framework": "m"}},
                 {"label": "b", "runner": "p", "meta": {"framework": p}}]
        return {"case": "c", "verdict": verdict, "exit_code": exit_code, "outcome": outcome, "message": message,
                "result": {"case": {"tokens": tokens, "runners": ["m", "p"]}, "checkpoint": {"digest": "abc"},
                           "message": message, "sides": sides, "expectation": {"verdict": "BITWISE_PASS"},
                           "tensors": [{"name": n, "status": "DIFF", "mismatches": m, "max_ulp": u}
                                       for n, m, u in tensors] + [{"name": "grad.input", "status": "EQUAL"}]}}

    def judged(e, k=known):
        b = {**table, "cases": {} if k is None else {"c": k}}
        return (lambda j: (j["status"], j["outcome"], j["changes"]))(records.judge_case(e, b))

    assert judged(entry()) == ("match", "pass", [])
    assert judged(entry(tensors=(("out", 3, 5),))) == ("changed", "fail", ["out: max ulp 4 → 5"])
    assert judged(entry(tensors=(("out", 2, 4),)))[:2] == ("changed", "fail")  # better, but not what it expects
    assert judged(entry(tensors=(("out", 3, 4), ("grad.weight", 1, 1))))[2] == [
        "grad.weight: new difference (1 mismatches, max ULP 1)"]
    assert judged(entry("BITWISE_PASS", 0, "pass", ()))[:2] == ("fixed", "fail")
    assert judged(entry("ERROR", 2, "fail", ())) == ("changed", "fail", ["verdict DIFF → ERROR"])
    crashed = {"case": "c", "verdict": "ERROR", "exit_code": 2, "outcome": "fail", "result": None}  # harness crash
    assert judged(crashed) == ("changed", "fail", ["verdict DIFF → ERROR"])
    assert judged(entry(tokens=60))[:2] == ("redefined", "fail")  # judged by its own expectation
    assert judged(entry(tokens=60))[2] == ["definition changed: tokens: 16 → 60"]
    assert judged(entry(), None)[:2] == ("new", "fail")
    assert judged(entry("UNSUPPORTED", 3, "skip", ()), None)[:2] == ("new", "skip")
    assert judged(entry("UNSUPPORTED", 3, "skip", (), message="no kernel"))[:2] == ("lost", "fail")
    assert judged(entry(p="p2")) == ("runner changed", "fail", ["side b (p) framework: p → p2",
                                                                 "tonight's numbers equal the record's"])
    assert judged(entry("BITWISE_PASS", 0, "pass", (), p="p2"))[:2] == ("runner changed", "pass")
    assert records.judge_case(entry(), None)["status"] == "no baseline"
    control = copy.deepcopy(known)
    met = entry(exit_code=0, outcome="pass", tensors=(("out", 5, 4),))
    met["result"]["expectation"] = {"verdict": "DIFF", "differs": ["out"]}
    assert judged(met, control) == ("changed", "fail", ["out: mismatches 3 → 5"])  # met, yet its numbers moved
    unsupported = copy.deepcopy(known) | {"verdict": "UNSUPPORTED", "reason": "p: no kernel", "differing": {}}
    assert judged(entry("UNSUPPORTED", 3, "skip", (), message="p: no kernel"), unsupported)[:2] == ("match", "skip")
    assert judged(entry("UNSUPPORTED", 3, "skip", (), message="p: other"), unsupported)[:2] == ("changed", "fail")
    assert judged(entry(), unsupported) == ("changed", "fail", ["verdict UNSUPPORTED → DIFF"])
    not_run = {"case": "c", "verdict": None, "outcome": "skip", "message": "not run: needs --weights"}
    assert judged(not_run)[:2] == ("lost", "fail")
    assert judged(not_run, unsupported)[:2] == ("not run", "skip")


def _night_entry(verdict, tensors, expectation, message="", tolerance=None, within=None):
    """A night entry whose case met its stated expectation (exit 0), with `tensors` [(name, mismatches, max ULP)]."""
    rows = [{"name": n, "status": "DIFF", "mismatches": m, "max_ulp": u} for n, m, u in tensors]
    return {"case": "c", "verdict": verdict, "exit_code": 0, "outcome": "pass", "message": message, "result": {
        "case": {"tokens": 16, "tolerance": tolerance}, "checkpoint": {"digest": "abc"}, "message": message,
        "expectation": {**expectation, "met": True}, "tolerance": {"within": within} if tolerance else {},
        "tensors": rows + [{"name": "grad.weight", "status": "EQUAL"}]}}


def test_a_met_expectation_never_passes_numbers_that_moved_from_the_record():
    """Issue 29, finding 2: kimi_rmsnorm states only `verdict = "DIFF"`; its Megatron side moved by one high bit (out
    max ULP 1 -> 8192) and the night passed ("expected"), as did an UNSUPPORTED whose reason changed from a missing
    kernel to a missing package. Both are "changed" now and fail, naming what changed. A case that states a
    tolerance may move its numbers within it, nothing else."""
    def judge(recorded, tonight):
        known = records.record(recorded)
        return records.judge_case(tonight, {"platform": {}, "runners": {}, "cases": {"c": known}})

    rmsnorm = {"verdict": "DIFF"}
    recorded = _night_entry("DIFF", [("out", 40, 1), ("grad.input", 12, 2)], rmsnorm)
    moved = judge(recorded, _night_entry("DIFF", [("out", 40, 8192), ("grad.input", 12, 2)], rmsnorm))
    assert (moved["status"], moved["outcome"], moved["changes"]) == ("changed", "fail", ["out: max ulp 1 → 8192"])
    assert judge(recorded, recorded)["status"] == "match"

    unsupported = {"verdict": "UNSUPPORTED"}
    kernel = _night_entry("UNSUPPORTED", [], unsupported, "paddle: kernel rms_norm (CPU, bfloat16) not registered")
    package = _night_entry("UNSUPPORTED", [], unsupported, "hf_model: transformers is not installed")
    changed = judge(kernel, package)
    assert (changed["status"], changed["outcome"]) == ("changed", "fail")
    assert "transformers is not installed" in changed["changes"][0]

    policy = {"limits": {"max_ulp_at_scale": 16}, "tensors": {}}
    tolerant = {"verdict": "WITHIN_TOLERANCE"}
    before = _night_entry("WITHIN_TOLERANCE", [("out", 5, 3)], tolerant, tolerance=policy, within=True)
    within = judge(before, _night_entry("WITHIN_TOLERANCE", [("out", 6, 4)], tolerant, tolerance=policy,
                                        within=True))
    assert (within["status"], within["outcome"]) == ("within tolerance", "pass")
    spread = judge(before, _night_entry("WITHIN_TOLERANCE", [("out", 5, 3), ("grad.input", 1, 1)], tolerant,
                                        tolerance=policy, within=True))
    assert (spread["status"], spread["outcome"]) == ("changed", "fail")  # another tensor differs: not a number


def test_a_long_record_lists_its_first_steps_and_still_catches_any_change(monkeypatch):
    """A training case differs in thousands of tensors: the record lists the earliest KEPT (step2 before step10) and
    keeps the count and sha256 of all, so a change past the listed ones still fails, and nothing else does."""
    monkeypatch.setattr(records, "KEPT_DIFFERING", 3)

    def entry(tensors):
        return {"case": "c", "verdict": "DIFF", "message": "", "result": {
            "case": {"tokens": 16}, "checkpoint": {"digest": "abc"}, "tensors": [
                {"name": n, "status": "DIFF", "mismatches": m, "max_ulp": 1} for n, m in tensors]}}

    steps = [("step10.loss", 1), ("step2.loss", 1), ("step1.grad.w", 4), ("step3.loss", 1), ("step2.grad.w", 2)]
    known = records.record(entry(steps))
    assert list(known["differing"]) == ["step1.grad.w", "step2.grad.w", "step2.loss"]
    assert known["differing_all"]["count"] == 5 and records.differing_count(known) == 5
    assert records.compare_records(known, records.record(entry(reversed(steps)))) == []
    late = records.compare_records(known, records.record(entry(steps[:-2] + [("step3.loss", 2), steps[-1]])))
    assert late == ["the differing tensors changed: 5 in the baseline (sha256 "
                    f"{known['differing_all']['sha256'][:12]}), 5 tonight"]
    fewer = records.compare_records(known, records.record(entry(steps[:-1])))  # step2.grad.w now equal
    assert len(fewer) == 1 and fewer[0].endswith("4 tonight")
    moved = records.compare_records(known, records.record(entry([*steps[:2], ("step1.grad.w", 5), *steps[3:]])))
    assert moved[1:] == ["step1.grad.w: mismatches 4 → 5"]  # a listed tensor is named
    assert records.expectation_met_by(known, {"verdict": "DIFF", "differs": ["step2.loss"], "equal": ["step1.x"]})
    assert not records.expectation_met_by(known, {"verdict": "DIFF", "equal": ["step3.loss"]})  # past the list
    assert not records.expectation_met_by(known, {"verdict": "DIFF", "equal": ["step9.grad.v"]})  # cannot say


@pytest.mark.slow  # 18 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_other_bits_with_the_same_counts_are_a_change(bench, capsys):
    """Issue 40, finding 7: a record pinned per tensor only the mismatch count and max ULP, so a night whose Paddle
    side computed three other elements apart, by the same bits (3 mismatches, max ULP 4 again), matched. A record now
    keeps each side's digest per differing tensor and one of the bitwise-equal ones: the night is `changed`, naming
    the tensor and the side whose bits moved."""
    written = bench.recorded(capsys)
    stored = json.loads(written.read_text())["cases"]["known_diff"]
    assert [len(stored["differing"]["out"]["bits"]), len(stored["equal_bits"])] == [2, 64]
    assert stored["differing"]["out"]["bits"][0] != stored["differing"]["out"]["bits"][1]
    moved = [["out", [0, 1], 0], ["out", [1, 3], 1], ["out", [3, 2], 2]]  # three other elements, the same bits
    bench.plan({"known_diff": {"flips": moved}})
    code, night, run_dir, out = bench.night(capsys)
    assert code == 1, out
    assert {c: (e["outcome"], e["baseline"]) for c, e in by_case(night).items()} == {
        "known_diff": ("fail", "changed"), "agrees": ("pass", "match"), "control": ("pass", "match")}
    [problem] = [p for p in by_case(night)["known_diff"]["problems"] if p.startswith("differs from the baseline")]
    assert problem.startswith("differs from the baseline: out: other bits on side b (a, b: "), problem
    tensor = next(t for t in by_case(night)["known_diff"]["result"]["tensors"] if t["name"] == "out")
    assert (tensor["mismatches"], tensor["max_ulp"]) == (3, 4)  # the counts the record held


def test_a_record_without_bits_is_judged_by_its_counts_and_one_with_bits_by_both():
    """Records made before records carried bits (the AMD files: nobody can record that platform here) keep being
    judged by verdict, counts and max ULP; a record with bits also fails when only the bits moved, the bitwise-equal
    tensors' included (both sides alike), and when tonight's run has no digests to check them."""
    def entry(out_bits=("xxh3_128:1", "xxh3_128:2"), equal_bits="xxh3_128:3", mismatches=3, digests=True):
        tensors = [{"name": "out", "status": "DIFF", "mismatches": mismatches, "max_ulp": 4,
                    "digests": list(out_bits)},
                   {"name": "grad.input", "status": "EQUAL", "digests": [equal_bits, equal_bits]}]
        if not digests:
            tensors = [{k: v for k, v in t.items() if k != "digests"} for t in tensors]
        return {"case": "c", "verdict": "DIFF", "exit_code": 1, "outcome": "fail", "message": "", "result": {
            "case": {"tokens": 16}, "checkpoint": {"digest": "abc"}, "expectation": {}, "tensors": tensors}}

    def judged(known, tonight):
        return (lambda j: (j["status"], j["changes"]))(records.judge_case(
            tonight, {"platform": {}, "runners": {}, "cases": {"c": known}}))

    hashed, counts_only = records.record(entry()), records.record(entry(), bits=False)
    assert records.has_bits(hashed) and not records.has_bits(counts_only)
    assert counts_only["differing"] == {"out": {"status": "DIFF", "mismatches": 3, "max_ulp": 4}}
    assert records.without_bits({"old": counts_only, "new": hashed}) == ["old"]
    other_out, other_equal = entry(out_bits=("xxh3_128:1", "xxh3_128:9")), entry(equal_bits="xxh3_128:8")
    assert judged(counts_only, other_out) == ("match", []) and judged(counts_only, other_equal) == ("match", [])
    assert judged(counts_only, entry(mismatches=4)) == ("changed", ["out: mismatches 3 → 4"])
    assert judged(hashed, entry()) == ("match", [])
    assert judged(hashed, other_out) == ("changed", [
        'out: other bits on side b (a, b: ["xxh3_128:1", "xxh3_128:2"] → ["xxh3_128:1", "xxh3_128:9"])'])
    status, [change] = judged(hashed, other_equal)
    assert status == "changed" and change.startswith("the bitwise-equal tensors hold other bits on both sides")
    assert judged(hashed, entry(mismatches=4)) == ("changed", ["out: mismatches 3 → 4"])  # counts name it already
    assert judged(hashed, entry(digests=False)) == ("changed", [
        "the record pins each side's bits; tonight's run has no digests to check them"])


def test_recording_again_over_a_record_without_bits_adds_them_and_says_so():
    """`baseline update` over a record made before records carried bits: the same counts are not called a change
    of every tensor; the case is listed as now pinning its bits, and the file no longer lists it without bits."""
    entry = {"case": "c", "verdict": "DIFF", "exit_code": 1, "outcome": "fail", "message": "", "result": {
        "case": {"tokens": 16}, "checkpoint": {"digest": "abc"}, "tensors": [
            {"name": "out", "status": "DIFF", "mismatches": 3, "max_ulp": 4, "digests": ["xxh3_128:1", "xxh3_128:2"]},
            {"name": "grad.input", "status": "EQUAL", "digests": ["xxh3_128:3", "xxh3_128:3"]}]}}
    night = {"run_id": "n", "device": "cpu", "harness": {"host": HOST}, "cases": [entry]}
    old = {"platform": records.platform(HOST, "cpu"), "runners": {}, "recorded_from": {}, "name": "x", "_file": "x",
           "cases": {"c": {**records.record(entry, bits=False), "runners": []}}}
    old["without_bits"] = {"cases": ["c"], "why": store.WITHOUT_BITS}
    [(new, changes, previous)] = store.build(night, [old])
    assert previous is old and changes == [
        {"case": "c", "change": "changed", "details": ["the same counts, now with each side's bits"]}]
    assert records.has_bits(new["cases"]["c"]) and "without_bits" not in new


def test_a_baseline_file_lists_its_records_without_bits(tmp_path):
    """A file says which of its records pin counts only (``without_bits``), and the fit check holds it to that."""
    registry = registry_from(tmp_path, tiny_case("one"))
    known = {"verdict": "DIFF", "definition": store.case_definition(registry.get("one")), "differing": {},
             "runners": []}
    table = {"platform": records.platform(HOST, "cpu"), "runners": {}, "cases": {"one": known}}
    assert store.fit_problems(table, registry) == [
        "field 'without_bits' lists [], but the records without each side's bits are ['one']"]
    assert store.fit_problems({**table, "without_bits": {"cases": ["one"], "why": store.WITHOUT_BITS}},
                              registry) == []
    hashed = {**table, "cases": {"one": {**known, "equal_bits": "0" * 64}}}
    assert store.fit_problems(hashed, registry) == []


def test_a_baseline_that_no_longer_fits_the_registry_or_the_fields_is_named(tmp_path):
    registry = registry_from(tmp_path, tiny_case("one"), tiny_case("two", seed=9))
    case = registry.get("one")
    good = {"platform": records.platform(HOST, "cpu"), "runners": {"megatron": {"framework": "megatron-core"}},
            "cases": {"one": {"verdict": "DIFF", "definition": store.case_definition(case), "differing": {},
                              "equal_bits": "0" * 64, "runners": ["megatron", None]}}}
    assert store.fit_problems(good, registry) == []
    stale = copy.deepcopy(good)
    stale["runners"]["megatron"]["env.ONEDNN_VERBOSE"] = "1"
    stale["cases"]["one"]["definition"]["tokens"] = 8  # recorded at 8 tokens: fits (the case is run at 8)
    stale["cases"]["one"]["definition"]["checkpoint_digest"] = "0" * 16
    stale["cases"]["gone"] = stale["cases"]["one"]
    problems = store.fit_problems(stale, registry)
    assert problems[0] == "runners.megatron: fields no longer in the fingerprint: env.ONEDNN_VERBOSE"
    assert problems[1].startswith("case one: definition changed: checkpoint_digest: 0000000000000000 → ")
    assert problems[2].startswith("case gone: not in today's registry as recorded")
    stated = registry_from(tmp_path, tiny_case("one", expect={"verdict": "BITWISE_PASS"}))
    assert store.fit_problems(good, stated) == ["case one: states BITWISE_PASS (differs [], equal []) but "
                                                         "this platform's record is DIFF (all equal): a stated "
                                                         "expectation holds on every platform; fix the case or leave "
                                                         "it to the baselines"]
    good["cases"]["one"]["verdict"] = "UNSUPPORTED"  # a kernel this platform lacks: no contradiction
    assert store.fit_problems(good, stated) == []


def test_every_committed_baseline_fits_the_registry_and_the_fingerprint_fields():
    """A case definition or a fingerprint field changed since a baseline was recorded: record it again."""
    registry = Registry.load()
    for known in store.load_all(store.BASELINES_DIR):
        problems = store.fit_problems(known, registry)
        tokens = (known.get("recorded_from") or {}).get("tokens")
        command = store.record_command(known["platform"]["device"], tokens)
        assert not problems, (f"{known['_file']} no longer fits: {'; '.join(problems[:5])}"
                              + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                              + f"; on that platform run `{command}` (or `python -m harness baseline update --from "
                              "NIGHT`) and commit baselines/")


@pytest.mark.slow  # two real Megatron nights: 38 s on 2 shared cores (the first tier's longest, 2026-12-06)
@pytest.mark.e2e
def test_real_megatron_night_is_green_the_second_time(tmp_path, monkeypatch, capsys, checkpoints_dir, no_doctor):
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
    assert stored["runners"]["megatron"]["framework"] == "megatron-core"
    assert stored["runners"]["megatron"]["env.OMP_NUM_THREADS"] == "2"  # the harness's pinned thread count
    assert set(stored["cases"]["tiny_flipped"]["differing"]) == {"out", "grad.weight"}
    capsys.readouterr()
    assert main(args) == 0
    assert f"baseline {written}: 1 match" in capsys.readouterr().out
    (second,) = sorted((tmp_path / "reports").glob("nightly-*"))[1:]
    night = json.loads((second / "report.json").read_text())
    assert night["cases"][0]["baseline"] == "match" and night["exit_code"] == 0
