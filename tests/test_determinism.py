"""--repeat N and --oracle through the real pipeline, with runner test doubles standing in for the frameworks.

The doubles (fake_*_python) are named as such; they test the harness's own logic (repeat rounds, the
self-comparison, verdict precedence, the oracle's distance table) and never produce a reported verdict.
"""

import json
import sys

import pytest

from harness import CompareOptions, compare_case
from tests.support.cases import tiny_case, write_cases
from tests.support.doubles import fake_interpreter

# Writes valid outputs for the tiny case. `out` is 1.0 everywhere, except that the flaky double, from its
# second run on, writes the next float above 1.0 into out[1, 2]: it agrees with the steady side at first.
FAKE_RUNNER = """\
#!{python}
import json, pathlib, sys
import numpy as np
from safetensors.numpy import save_file
request = json.loads(pathlib.Path(sys.argv[sys.argv.index("--request") + 1]).read_text())
folder = pathlib.Path(request["output_dir"])
t, n_in, n_out = request["tokens"], request["shapes"]["input_size"], request["shapes"]["output_size"]
counter = pathlib.Path({counter!r})
run = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(run))
out = np.ones((t, n_out), np.float32)
if {flaky} and run > 1:
    out[1, 2] = np.nextafter(np.float32(1), np.float32(2))
tensors = {{"out": out, "grad.input": np.zeros((t, n_in), np.float32),
            "grad.weight": np.zeros((n_out, n_in), np.float32)}}
if {exact}:  # the exact result, computed like the oracle: a side that is right by construction
    from safetensors.numpy import load_file
    inputs = {{k: v.astype(np.float64) for path in request["checkpoint"] for k, v in load_file(path).items()}}
    x, w, dy = inputs["input"], inputs["weight"], inputs["grad_output"]
    tensors = {{"out": x @ w.T, "grad.input": dy @ w, "grad.weight": dy.T @ x}}
    tensors = {{k: v.astype(np.float32) for k, v in tensors.items()}}
save_file(tensors, str(folder / "outputs.safetensors"))
(folder / "meta.json").write_text(json.dumps({{"runner": "fake", "run": run}}))
"""


def fake_runner(folder, name, flaky=False, exact=False):
    body = FAKE_RUNNER.format(python=sys.executable, counter=str(folder / f"{name}.runs"), flaky=flaky, exact=exact)
    return fake_interpreter(folder, name, body)


@pytest.fixture
def env(tmp_path):
    write_cases(tmp_path, tiny_case())
    return tmp_path


def run(env, pythons, **options):
    """These doubles serve one request per process (no ``--worker``): every run is a fresh process."""
    return compare_case("tiny", CompareOptions(cases_dir=env / "cases", checkpoints_dir=env / "ck",
                                               reports_dir=env / "reports", pythons=pythons, timeout=120.0,
                                               fresh_process=True, **options))


def test_a_side_that_changes_its_bits_is_nondeterministic_even_if_its_first_run_agrees(env):
    pythons = {"megatron": fake_runner(env, "fake_flaky_python", flaky=True),
               "paddle": fake_runner(env, "fake_steady_python")}
    result, run_dir = run(env, pythons, oracle=False, repeat=3)
    assert [s.label for s in result.sides] == ["a", "b", "a.2", "b.2", "a.3", "b.3"]
    assert result.tensors and all(t.status == "EQUAL" for t in result.tensors)  # the first runs agree bitwise
    assert result.verdict == "NONDETERMINISTIC" and result.exit_code == 4
    assert "a (megatron)" in result.message and "bitwise equal" in result.message
    report = json.loads((run_dir / "report.json").read_text())
    flaky, steady = report["repeats"]["sides"]["a"], report["repeats"]["sides"]["b"]
    assert (flaky["consistent"], steady["consistent"]) == (False, True)
    second = flaky["repeats"][0]
    assert second["label"] == "a.2" and second["differing"] == ["out"]
    out = next(t for t in second["tensors"] if t["name"] == "out")
    assert out["mismatches"] == 1 and out["max_ulp"] == 1 and out["first_mismatch"]["index"] == [1, 2]
    markdown = (run_dir / "report.md").read_text()
    assert "## Determinism: 3 runs per side" in markdown
    assert "### a.2 (fresh process) against its first run" in markdown


def test_self_consistent_sides_keep_the_cross_framework_verdict(env):
    # one double per side: a shared run counter is a race between the two sides, which run at once
    result, _ = run(env, {"megatron": fake_runner(env, "fake_steady_a_python"),
                          "paddle": fake_runner(env, "fake_steady_b_python")}, oracle=False, repeat=2)
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0
    assert all(side["consistent"] for side in result.repeats["sides"].values())


def test_no_repeats_after_a_crash(env):
    crash = fake_interpreter(env, "fake_crashing_python", "#!/bin/sh\nexit 9\n")
    result, _ = run(env, {"megatron": crash, "paddle": fake_runner(env, "fake_steady_python")}, oracle=False,
                    repeat=3)
    assert result.verdict == "ERROR" and [s.label for s in result.sides] == ["a", "b"]


def test_oracle_side_shows_which_side_is_closer(env):
    pythons = {"megatron": fake_runner(env, "fake_exact_python", exact=True),
               "paddle": fake_runner(env, "fake_steady_python")}
    result, run_dir = run(env, pythons)
    assert [s.label for s in result.sides] == ["a", "b", "oracle"]
    assert result.verdict == "DIFF"  # the oracle never decides the verdict; it measures
    report = json.loads((run_dir / "report.json").read_text())["versus_oracle"]
    assert report["status"] == "ok"
    assert [t["mismatches"] for t in report["sides"]["a"]["tensors"]] == [0, 0, 0]
    assert all(t["mismatches"] > 0 for t in report["sides"]["b"]["tensors"])
    assert report["closer"] == {"out": "a", "grad.input": "a", "grad.weight": "a"}
    assert "## Distance from the truth oracle" in (run_dir / "report.md").read_text()


def test_a_case_that_turns_the_truth_off_runs_no_oracle_side(tmp_path):
    write_cases(tmp_path, tiny_case(truth=False))
    pythons = {"megatron": fake_runner(tmp_path, "fake_exact_python", exact=True),
               "paddle": fake_runner(tmp_path, "fake_steady_python")}
    result, _ = run(tmp_path, pythons)
    assert [s.label for s in result.sides] == ["a", "b"] and result.verdict == "DIFF"


def test_a_signal_during_repeats_lets_the_oracle_round_end_before_the_runs_own_workers(env, monkeypatch):
    """compare --repeat N has workers of its own, closed when its runs end; the oracle's round, run beside the pair,
    ends first, also when a signal stops the pair (else it may start a worker in a pool already closed)."""
    import threading

    from harness.pipeline import comparison
    from harness.run import supervisor, workers

    events, closed, real_close = [], threading.Event(), workers.Pool.close

    def close(pool):
        events.append("workers closed")
        closed.set()
        real_close(pool)

    def run_sides_double(case, sides, *args):  # named double: the pair stopped by a signal, the oracle still running
        if sides[0].label == "oracle":
            closed.wait(1.0)
            events.append("oracle round ended")
            return []
        raise KeyboardInterrupt

    monkeypatch.setattr(workers.Pool, "close", close)
    monkeypatch.setattr(comparison.orchestrate, "run_sides", run_sides_double)
    with pytest.raises(supervisor.Interrupted):
        compare_case("tiny", CompareOptions(cases_dir=env / "cases", checkpoints_dir=env / "ck",
                                            reports_dir=env / "reports", repeat=2))
    assert events == ["oracle round ended", "workers closed"]
