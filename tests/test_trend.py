"""The trend section on planted pairs of nightly reports: a regression, a fix, and cases coming and going."""

import copy

from harness.baselines import trend
from harness.report import blocks as doc


def side(runner, torch="2.13.0+cpu", isa=("avx", "avx2")):
    return {"label": "a", "runner": runner, "status": "ok", "stderr_tail": "",
            "meta": {"runner": runner, "case": "x", "phases": {"forward": 0.1}, "executable": "/env/bin/python",
                     "versions": {"megatron-core": "0.16.1"}, "torch": torch,
                     "host": {"cpu": "AMD EPYC", "cpu_isa": list(isa)}}}


def tensor(name, mismatches, max_ulp):
    return {"name": name, "status": "DIFF" if mismatches else "EQUAL", "mismatches": mismatches, "max_ulp": max_ulp}


def entry(name, outcome, verdict, tensors, tokens=16, message="", **side_args):
    return {"case": name, "outcome": outcome, "verdict": verdict, "message": message, "problems": [],
            "result": {"case": {"op": "column_parallel_linear", "dtype": "bfloat16", "tp": 1, "tokens": tokens},
                       "sides": [side("megatron", **side_args)], "tensors": tensors}}


def night(run_id, *entries):
    return {"schema": 1, "kind": "nightly", "run_id": run_id, "device": "cpu", "cases": list(entries)}


PASSING = night("nightly-1",
                entry("fc1", "pass", "BITWISE_PASS", [tensor("out", 0, 0), tensor("grad.input", 0, 0)]),
                entry("fc1_fp32", "pass", "DIFF", [tensor("out", 900, 12)]),
                entry("old_case", "pass", "BITWISE_PASS", [tensor("out", 0, 0)]))
REGRESSED = night("nightly-2",
                  entry("fc1", "fail", "DIFF", [tensor("out", 333, 1), tensor("grad.input", 0, 0)],
                        message="1 of 2 tensors differ: out", torch="2.14.0+cpu"),
                  entry("fc1_fp32", "pass", "DIFF", [tensor("out", 950, 12)], torch="2.14.0+cpu"),
                  entry("new_case", "skip", "UNSUPPORTED", [], torch="2.14.0+cpu"))


def test_planted_regression():
    t = trend.compare(PASSING, REGRESSED)
    assert t["previous"] == "nightly-1"
    assert t["new_failures"] == [{"case": "fc1", "before": "PASS (BITWISE_PASS)", "after": "FAIL (DIFF)",
                                  "message": "1 of 2 tensors differ: out"}]
    assert t["fixes"] == [] and t["other_changes"] == []
    assert t["metric_changes"] == [
        {"case": "fc1", "tensor": "out", "status": ["EQUAL", "DIFF"], "mismatches": [0, 333], "max_ulp": [0, 1]},
        {"case": "fc1_fp32", "tensor": "out", "status": ["DIFF", "DIFF"], "mismatches": [900, 950],
         "max_ulp": [12, 12]}]
    assert t["new_cases"] == [{"case": "new_case", "state": "SKIP (UNSUPPORTED)"}]
    assert t["removed_cases"] == [{"case": "old_case", "state": "PASS (BITWISE_PASS)"}]
    assert t["provenance_changes"] == [{"field": "megatron torch", "before": "2.13.0+cpu", "after": "2.14.0+cpu"}]
    assert t["case_changes"] == []

    text = doc.markdown(trend.blocks(t))
    assert "## What changed since `nightly-1`" in text
    assert "### New failures (1)\n\n- `fc1`: PASS (BITWISE_PASS) → **FAIL (DIFF)** — 1 of 2 tensors differ: out" in text
    assert "| `fc1` | `out` | EQUAL → DIFF | 0 → 333 | 0 → 1 |" in text
    assert "| `fc1_fp32` | `out` | DIFF | 900 → 950 | 12 |" in text
    assert "### Removed cases (1)\n\n- `old_case`: PASS (BITWISE_PASS)" in text
    assert "| `megatron torch` | `2.13.0+cpu` | `2.14.0+cpu` |" in text
    assert "Fixes" not in text


def test_planted_fix():
    fixed = night("nightly-3",
                  entry("fc1", "pass", "BITWISE_PASS", [tensor("out", 0, 0), tensor("grad.input", 0, 0)],
                        message="all 2 tensors bitwise equal", torch="2.14.0+cpu", isa=("avx", "avx2", "avx512f")),
                  copy.deepcopy(REGRESSED["cases"][1]), copy.deepcopy(REGRESSED["cases"][2]))
    t = trend.compare(REGRESSED, fixed)
    assert t["fixes"] == [{"case": "fc1", "before": "FAIL (DIFF)", "after": "PASS (BITWISE_PASS)",
                           "message": "all 2 tensors bitwise equal"}]
    assert t["new_failures"] == [] and t["new_cases"] == [] and t["removed_cases"] == []
    assert t["metric_changes"] == [{"case": "fc1", "tensor": "out", "status": ["DIFF", "EQUAL"],
                                    "mismatches": [333, 0], "max_ulp": [1, 0]}]
    # the first case's runner meta wins per field; the CPU gained AVX-512 on the fixed night
    assert t["provenance_changes"] == [{"field": "megatron host.cpu_isa", "before": "avx avx2",
                                        "after": "avx avx2 avx512f"}]
    text = doc.markdown(trend.blocks(t))
    assert "### Fixes (1)\n\n- `fc1`: FAIL (DIFF) → **PASS (BITWISE_PASS)**" in text
    assert "| `megatron host.cpu_isa` | `avx avx2` | `avx avx2 avx512f` |" in text
    assert "New failures" not in text


def test_same_night_twice_reports_nothing_and_tokens_change_is_named():
    assert not trend.changed(trend.compare(PASSING, copy.deepcopy(PASSING)))
    assert "Nothing:" in doc.markdown(trend.blocks(trend.compare(PASSING, copy.deepcopy(PASSING))))
    longer = copy.deepcopy(PASSING)
    longer["cases"][0]["result"]["case"]["tokens"] = 60
    t = trend.compare(PASSING, longer)
    assert t["case_changes"] == [{"case": "fc1", "field": "tokens", "before": 16, "after": 60}]


def test_a_night_in_memory_matches_the_same_night_read_back_from_json():
    in_memory = copy.deepcopy(PASSING)
    in_memory["cases"][0]["result"]["case"]["runners"] = ("megatron", "paddle")  # as dataclasses.asdict gives
    stored = copy.deepcopy(PASSING)
    stored["cases"][0]["result"]["case"]["runners"] = ["megatron", "paddle"]
    assert not trend.changed(trend.compare(stored, in_memory))


def test_first_night_is_the_baseline():
    t = trend.compare(None, PASSING)
    assert t == {"previous": None}
    assert "this night is the baseline" in doc.markdown(trend.blocks(t))


def test_volatile_meta_is_not_provenance():
    flat = trend.provenance(PASSING)
    assert flat == {"megatron host.cpu": "AMD EPYC", "megatron host.cpu_isa": "avx avx2",
                    "megatron torch": "2.13.0+cpu", "megatron versions.megatron-core": "0.16.1"}
