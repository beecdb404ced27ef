"""Test axes. End-to-end tests are parametrized over the registry's CPU cases; ids are case names."""

from __future__ import annotations

import pytest

from harness.case.registry import Registry

CPU_CASES = Registry.load().for_device("cpu")
# Token count for end-to-end runs: small enough for 2 cores (torch's bf16 GEMM on a CPU without
# AVX-512 is a slow scalar fallback), large enough to cross several GEMM blocks.
E2E_TOKENS = 16


def pytest_generate_tests(metafunc):
    if "cpu_case" in metafunc.fixturenames:
        metafunc.parametrize("cpu_case", CPU_CASES, ids=[case.name for case in CPU_CASES])


@pytest.fixture(scope="session")
def checkpoints_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")
