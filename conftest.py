"""Test axes. End-to-end tests are parametrized over the registry's CPU cases; ids are case names."""

from __future__ import annotations

import os

import pytest

from harness.case.registry import Registry
from harness.run import workers

# Whole-model cases run in tests/test_model_e2e.py (a few, small: each side imports a model zoo and runs a model).
CPU_CASES = [case for case in Registry.load().for_device("cpu") if case.op_spec.level == "op"]
# Token count for end-to-end runs: small enough for 2 cores (torch's bf16 GEMM on a CPU without
# AVX-512 is a slow scalar fallback), large enough to cross several GEMM blocks.
E2E_TOKENS = 16


def pytest_generate_tests(metafunc):
    if "cpu_case" in metafunc.fixturenames:
        metafunc.parametrize("cpu_case", CPU_CASES, ids=[case.name for case in CPU_CASES])


# The environment the test session started with, before any test module was imported; TorchDynamo off, as the
# harness sets it for every runner (in-process Megatron tests set it at import too: jit_fuser is torch.compile).
SESSION_ENVIRONMENT = {**os.environ, "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}


@pytest.fixture(autouse=True)
def environment_restored():
    """Every test starts and ends with the session's environment: importing paddle (at a test module's import, or in
    a test) sets OMP_NUM_THREADS=1 in the pytest process, which every runner started later would inherit (measured:
    79 e2e cases then ran at 1 thread against baselines recorded at the harness's pinned 2)."""
    _reset_environment()
    yield
    _reset_environment()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The session's environment before any fixture of a test is set up, a module's or a session's too: a test
    module that imports paddle at collection leaves OMP_NUM_THREADS=1 behind, and a module fixture set up before the
    autouse fixture above started its runners at 1 thread (tests/test_attach_hf.py's built-in runs, first in a full
    `make test`, then parted by 1 ULP from the Trainer that ran at 2)."""
    _reset_environment()


def _reset_environment():
    current = os.environ.get("PYTEST_CURRENT_TEST")  # pytest's own, which it deletes after each phase
    os.environ.clear()
    os.environ.update(SESSION_ENVIRONMENT)
    if current is not None:
        os.environ["PYTEST_CURRENT_TEST"] = current


@pytest.fixture(scope="session")
def checkpoints_dir(tmp_path_factory):
    """One checkpoints folder for the whole run, shared by the pytest-xdist workers too (each worker's base folder
    sits in the run's): the weights every case shares are made once per run, not once per worker (a checkpoint is
    written atomically, so two workers may make the same one at once)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "checkpoints"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def runner_workers(tmp_path_factory):
    """A module's runs through one pool of runner workers (harness.run.workers), as a nightly runs its cases: each
    framework is imported once per test module and process, not once per case and side (tests/test_workers.py
    shows that workers write the bits fresh processes write)."""
    with workers.serving(tmp_path_factory.mktemp("runner-workers")):
        yield
