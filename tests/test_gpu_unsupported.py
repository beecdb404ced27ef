"""`--device gpu` where the GPU stack is missing ends UNSUPPORTED with the reason, never ERROR or a crash.

On this project's CPU machines torch sees no CUDA device and Paddle is a CPU build, so the real runners must
say exactly that. A Paddle-less environment is simulated by a test double interpreter (named fake_*) that runs
this Python with a `paddle` package on its path that fails to import; it tests the harness's handling only.
"""

import stat
import textwrap

import pytest
import torch

from harness.commands.compare import CompareOptions, compare_case
from tests.support.cases import tiny_case, write_cases

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


def fake_paddleless_python(folder):
    """This interpreter, with a `paddle` package first on its path whose import fails like a missing package."""
    hidden = folder / "fake_paddleless_site" / "paddle"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("No module named \'paddle\' (hidden by a test double)")\n')
    wrapper = folder / "fake_paddleless_python"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        PYTHONPATH="{hidden.parent}:$PYTHONPATH" exec {__import__('sys').executable} "$@"
        """))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_gpu_environment_without_paddle_is_unsupported(env):
    result, _ = run(env, ("paddle", "paddle"), {"paddle": fake_paddleless_python(env)})
    assert result.verdict == "UNSUPPORTED", result.message
    assert all("paddle is not importable" in s.reason and "hidden by a test double" in s.reason
               for s in result.sides)
