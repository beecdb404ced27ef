"""conftest.py gives every test, and every fixture its setup creates, the environment the session started with: a test
module that imports paddle leaves OMP_NUM_THREADS=1 behind at collection, and runners started by a module fixture
inherited it (a full `make test` parted tests/test_attach_hf.py's built-in runs from the Trainer by 1 ULP)."""

import os

import pytest

import conftest

os.environ["HARNESS_LEAKED_AT_IMPORT"] = "1"  # what importing paddle does to OMP_NUM_THREADS, at this module's import


@pytest.fixture(scope="module")
def seen_by_a_module_fixture():
    return dict(os.environ)


def test_a_module_fixture_starts_from_the_sessions_environment(seen_by_a_module_fixture):
    assert "HARNESS_LEAKED_AT_IMPORT" not in seen_by_a_module_fixture


def test_the_reset_runs_before_any_fixture_of_a_test():
    os.environ["OMP_NUM_THREADS"] = "1"
    conftest.pytest_runtest_setup(None)
    assert os.environ.get("OMP_NUM_THREADS") == conftest.SESSION_ENVIRONMENT.get("OMP_NUM_THREADS")
    assert conftest.pytest_runtest_setup.pytest_impl["tryfirst"]  # before pytest's own setup sets up fixtures
