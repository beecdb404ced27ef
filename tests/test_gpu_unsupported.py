"""`--device gpu` where the GPU stack is missing ends UNSUPPORTED with the reason, never ERROR or a crash.

On this project's CPU machines torch sees no CUDA device and Paddle is a CPU build, so the real runners must
say exactly that. A Paddle-less environment is simulated by a test double interpreter
(``tests.support.doubles.missing_package_python``: this Python, with paddle hidden as Python hides a package it cannot
find); it tests the harness's handling only.
"""

import pytest
import torch

from harness import CompareOptions, compare_case
from tests.support.cases import tiny_case, write_cases
from tests.support.doubles import missing_package_python

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(torch.cuda.is_available(), reason="tests a machine without a CUDA device")]

@pytest.fixture
def env(tmp_path):
    write_cases(tmp_path, tiny_case(dtype="bfloat16", devices=["cpu", "gpu"]))
    return tmp_path


def run(env, runners, pythons=None):
    return compare_case("tiny", CompareOptions(device="gpu", runners=runners, cases_dir=env / "cases",
                                               checkpoints_dir=env / "ck", reports_dir=env / "reports",
                                               pythons=pythons or {}, oracle=False))  # the pair is under test


def test_megatron_and_cpu_paddle_on_gpu_are_unsupported(env):
    result, run_dir = run(env, ("megatron", "paddle"))
    assert result.verdict == "UNSUPPORTED" and result.exit_code == 3, result.message
    megatron, paddle = result.sides
    assert megatron.status == "unsupported" and "sees no CUDA device" in megatron.reason
    assert paddle.status == "unsupported" and "is a CPU build" in paddle.reason
    assert "sees no CUDA device" in (run_dir / "report.md").read_text()


def test_plain_torch_on_gpu_is_unsupported(env):
    result, _ = run(env, ("torch", "torch_nn"))
    assert result.verdict == "UNSUPPORTED", result.message
    assert all(s.status == "unsupported" and "sees no CUDA device" in s.reason for s in result.sides)


def test_gpu_environment_without_paddle_is_unsupported(env):
    """Paddle not installed (a test double hides it from the runner's interpreter): UNSUPPORTED naming it."""
    result, _ = run(env, ("paddle", "paddle"), {"paddle": missing_package_python(env, "paddle")})
    assert result.verdict == "UNSUPPORTED", result.message
    assert all(s.reason.startswith("paddle is not installed for ") and "hidden by a test double" in s.reason
               for s in result.sides), [s.reason for s in result.sides]
