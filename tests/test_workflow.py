"""The nightly workflow passes actionlint, and runs the Makefile command this repository defines.

actionlint comes from requirements-cpu.txt (its binary lands beside the interpreter); a broken workflow
planted here proves the linter really reports problems.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "nightly.yml"
HF523 = ".venv-hf523/.installed"  # the Makefile's stamp of the second transformers' environment


@pytest.fixture(scope="module")
def actionlint():
    beside = Path(sys.executable).parent / "actionlint"
    found = str(beside) if beside.exists() else shutil.which("actionlint")
    assert found, "actionlint is missing: pip install -r requirements-cpu.txt"
    return found


def lint(actionlint, path):
    return subprocess.run([actionlint, "-no-color", str(path)], capture_output=True, text=True, timeout=120)


def test_nightly_workflow_passes_actionlint(actionlint):
    result = lint(actionlint, WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_reports_a_broken_workflow(actionlint, tmp_path):
    broken = WORKFLOW.read_text().replace("steps.nightly.outputs.run_dir", "steps.nigthly.outputs.run_dir", 1)
    (tmp_path / "nightly.yml").write_text(broken)
    result = lint(actionlint, tmp_path / "nightly.yml")
    assert result.returncode == 1 and "nigthly" in result.stdout, result.stdout + result.stderr


def test_workflow_command_is_the_makefile_target():
    text = WORKFLOW.read_text()
    assert 'make nightly PYTHON="$HARNESS_PYTHON" DEVICE=gpu TOKENS="$TOKENS_INPUT" ARGS="$previous"' in text
    assert 'make nightly DEVICE=cpu TOKENS="${TOKENS_INPUT:-16}" ARGS="--shard $SHARD"' in text
    assert "python -m harness nightly-merge shards/*/ $previous" in text
    dry = subprocess.run(["make", "-s", "-n", "-o", HF523, "nightly", "PYTHON=py", "DEVICE=gpu", "TOKENS=16",
                          "ARGS=--previous prev/report.json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.stdout.strip() == "py -m harness nightly --device gpu --tokens 16 --previous prev/report.json", dry


def test_ci_runs_both_tiers_and_make_test_leaves_the_second_out():
    """`make test` (the README's command) deselects the tests marked `slow`, `make test-slow` runs only those, and CI
    (.ci/run) runs both, so moving a test to the second tier never takes it out of CI."""
    def dry(target, *flags):  # as a fresh shell runs it: not the PYTEST_ARGS a `make test PYTEST_ARGS=...` passes
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ARGS",
                                                               "TEST_MARKERS")}
        return subprocess.run(["make", "-s", "-n", *flags, target, "PYTHON=py"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env=env).stdout.strip().splitlines()

    # the second transformers' environment taken as made (-o), whatever state this checkout's copy is in
    assert dry("test", "-o", HF523)[-1] == 'py -m pytest -n 2 -m "not slow"', dry("test", "-o", HF523)
    assert dry("test-slow", "-o", HF523) == ["py -m pytest -n 2 -m slow"], dry("test-slow", "-o", HF523)
    # and made first where it is not (a clean clone: CI)
    make_env = "py -m harness.environments transformers-5.23.0"
    assert dry("test-slow", "-B") == [make_env, "py -m pytest -n 2 -m slow"], dry("test-slow", "-B")
    assert dry("test", "-B")[0] == make_env, dry("test", "-B")
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'make test PYTEST_ARGS="-v --durations=15" || status=$?' in ci
    assert 'make test-slow PYTEST_ARGS="-v --durations=15" || status=$?' in ci
    assert ci.rstrip().endswith('exit "$status"')
