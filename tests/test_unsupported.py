"""UNSUPPORTED means one thing: a named package that is not installed, or a kernel the framework says is missing.
Anything else a runner meets is an ERROR with its traceback (harness.run.protocol.import_failure, the Paddle runner's
kernel guard, harness.runners.paddle.levels).

- Import failures, framework-free: Python's ModuleNotFoundError naming the package (or a package above it) is "not
  installed"; a dependency missing inside an installed package, or any other error, is a broken install.
- The Paddle runner's kernel guard (harness.runners.paddle.guard, with the ISA as a test double): Paddle's "not
  registered" and oneDNN's dnnl::error on a CPU where oneDNN has no AVX-512 are UNSUPPORTED; any other exception is
  raised, on every CPU (the old guard made any exception on a bf16 CPU without AVX-512 UNSUPPORTED).
- End to end on real Paddle: with oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, this CPU's way to be the CI's AVX2
  CPU) the bf16 linear is UNSUPPORTED naming dnnl::error; a PaddleFormers that is installed but does not import (a
  test double on the runner's path) makes an ``auto`` case an ERROR naming it, where the old code ran the recipe.
- The verdict names the refusing runner once: ``harness.compare.result.decide`` puts the runner's name before its
  reason, so a runner room's own message never starts with it (the Megatron room's did: "megatron_model:
  megatron_model: DeepSeek Sparse Attention's indexer needs ...").
- flash-linear-attention refusing the Triton on a Hopper GPU (a RuntimeError in its gated backward, measured on an
  H100) is UNSUPPORTED naming Triton >= 3.7.1 or tilelang, fla's text kept; tested on fla's real message against the
  harness's own logic (no GPU here); any other RuntimeError stays an ERROR.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness.run.protocol import BrokenInstall, Unsupported, import_failure
from harness.runners.paddle import guard
from tests.support.doubles import broken_install_python
from tests.support.installed import absent


def _not_found(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.mark.parametrize("missing", ["megatron", "megatron.core"])
def test_the_package_itself_missing_is_unsupported(missing):
    failure = import_failure("megatron.core", _not_found(missing))
    assert isinstance(failure, Unsupported) and str(failure).startswith("megatron.core is not installed for ")


@pytest.mark.parametrize("error", [_not_found("einops"), _not_found("megatron.core.transformer"),
                                   ImportError("cannot import name 'X' from 'megatron.core'"),
                                   RuntimeError("CUDA driver mismatch at import")])
def test_anything_else_is_a_broken_install(error):
    failure = import_failure("megatron.core", error)
    assert isinstance(failure, BrokenInstall), failure
    assert str(failure).startswith("megatron.core is installed for ") and type(error).__name__ in str(failure)


BF16_CPU = {"device": "cpu", "dtype": "bfloat16"}


def test_a_kernel_paddle_says_is_not_registered_is_unsupported():
    def call():
        raise RuntimeError("(NotFound) The kernel with key (CPU, Undefined(AnyLayout), bfloat16) of kernel `matmul` "
                           "is not registered.\n  [Hint: ...]")
    with pytest.raises(Unsupported, match="matmul on cpu in bfloat16: .*kernel `matmul` is not registered"):
        guard.kernel_guard(call, "matmul", BF16_CPU)


@pytest.mark.parametrize("isa", [["avx2", "fma"], ["avx2", "avx512f", "avx512_bf16", "fma"]])
def test_any_other_exception_is_raised_on_every_cpu(monkeypatch, isa):
    monkeypatch.setattr(guard, "cpu_isa_flags", lambda: isa)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def call():
        raise ValueError("a bug in the harness's own code")
    with pytest.raises(ValueError, match="a bug"):
        guard.kernel_guard(call, "oneDNN bf16 linear (static graph)", BF16_CPU)


def _dnnl_error():
    os.write(2, b"W1201 pir_interpreter.cc:2045] onednn_op.matmul raises an exception dnnl::error\n")
    raise RuntimeError("std::exception")


def test_onednn_failing_without_avx512_is_unsupported_naming_what_paddle_logged(monkeypatch, capfd):
    monkeypatch.setattr(guard, "cpu_isa_flags", lambda: ["avx2", "fma"])
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with pytest.raises(Unsupported) as raised:
        guard.kernel_guard(_dnnl_error, "oneDNN bf16 linear (static graph)", BF16_CPU)
    assert "onednn_op.matmul raises an exception dnnl::error" in str(raised.value)
    assert "oneDNN's bf16 matmul needs AVX-512" in str(raised.value) and "avx2 fma" in str(raised.value)
    assert "dnnl::error" in capfd.readouterr().err  # the log still reaches the cell's stderr


def test_onednn_failing_with_avx512_or_in_float32_is_raised(monkeypatch):
    monkeypatch.setattr(guard, "cpu_isa_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with pytest.raises(RuntimeError, match="std::exception"):
        guard.kernel_guard(_dnnl_error, "oneDNN bf16 linear (static graph)", BF16_CPU)
    monkeypatch.setattr(guard, "cpu_isa_flags", lambda: ["avx2"])
    with pytest.raises(RuntimeError, match="std::exception"):
        guard.kernel_guard(_dnnl_error, "linear", {"device": "cpu", "dtype": "float32"})


def _compare(name, tmp_path, **options):
    from harness import CompareOptions, compare_case

    return compare_case(name, CompareOptions(oracle=False, tokens=4, checkpoints_dir=tmp_path / "ckpt",
                                             reports_dir=tmp_path / "reports", **options))


@pytest.mark.e2e
def test_paddle_bf16_linear_with_onednn_capped_at_avx2_is_unsupported_naming_dnnl_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    result, _ = _compare("kimi_mla_q_a", tmp_path, runners=("paddle", "paddle"))
    assert result.verdict == "UNSUPPORTED", (result.message, [s.stderr_tail[-1500:] for s in result.sides])
    reason = result.sides[0].reason
    assert "dnnl::error" in reason and "ONEDNN_MAX_CPU_ISA=AVX2" in reason, reason


@pytest.mark.e2e
def test_an_installed_but_broken_paddleformers_makes_auto_an_error_naming_it(tmp_path):
    python = broken_install_python(tmp_path, "paddleformers")
    result, _ = _compare("kimi_rmsnorm_fp32_paddleformers", tmp_path, runners=("paddle", "paddle"),
                         config_overrides={"paddle_impl": "auto"}, pythons={"paddle": python})
    assert result.verdict == "ERROR", result.message
    tail = result.sides[0].stderr_tail
    assert "BrokenLevel: PaddleFormers' module (not PaddleFleet): paddleformers is installed but does not import" \
        in tail, tail[-2000:]
    assert "paddleformers_test_double_missing_dependency" in tail


@pytest.mark.skipif(absent("torch", "megatron.core"), reason="the Megatron room's refusal imports megatron.core")
def test_an_unsupported_verdict_names_the_refusing_runner_once():
    import torch

    from harness.compare.result import decide
    from harness.families import model_config
    from harness.run.orchestrate import SideResult
    from harness.runners.megatron import families
    from tests.support.tiny_models import TINY

    with pytest.raises(Unsupported) as refused:
        families.translate_config(model_config(TINY["glm_moe_dsa"]), torch.float32, torch.device("cpu"))
    sides = [SideResult("a", "megatron_model", "unsupported", Path("/nowhere"), "python", reason=str(refused.value)),
             SideResult("b", "hf_model", "ok", Path("/nowhere"), "python")]
    verdict, message = decide(sides, [])
    assert verdict == "UNSUPPORTED"
    assert message.startswith("megatron_model: DeepSeek Sparse Attention's indexer needs "), message


def test_no_runner_room_starts_a_refusal_with_a_runner_name():
    """Every room at once: an ``Unsupported("<runner>: ...")`` in harness/runners would say the name twice."""
    from harness.case.registry import RUNNERS

    opens = re.compile(r'Unsupported\(\s*f?"(' + "|".join(RUNNERS) + r'): ')
    rooms = Path(__file__).resolve().parents[1] / "harness" / "runners"
    found = [f"{path.relative_to(rooms)}: {match.group(0)}" for path in sorted(rooms.rglob("*.py"))
             for match in opens.finditer(path.read_text())]
    assert found == []


# fla 0.6.0's refusal, as an H100 with triton 3.6.0 raised it (docs/examples/zoo/qwen35_gpu_h100_full.md), and the
# words of earlier fla releases, which named no fixed Triton
FLA_HOPPER = ("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg (see "
              "#640). Please upgrade Triton to >= 3.7.1 or install tilelang: `pip install tilelang`")
FLA_HOPPER_EARLIER = ("Triton >= 3.4.0 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg (see #640). "
                      "Please install tilelang: `pip install tilelang`")


@pytest.mark.parametrize(("said", "needed"), [(FLA_HOPPER, "Triton >= 3.7.1 or tilelang"),
                                              (FLA_HOPPER_EARLIER, "tilelang")])
def test_harness_logic_fla_refusing_triton_on_hopper_is_unsupported_naming_the_package(said, needed):
    from harness.runners.torch import fla_refusal

    with pytest.raises(Unsupported) as refused, fla_refusal.refusal_as_unsupported():
        raise RuntimeError(said)
    reason = str(refused.value)
    assert reason.startswith(f"flash-linear-attention needs {needed} for gated chunk_bwd_dqkwg on a Hopper GPU "
                             "(installed here: triton "), reason
    assert reason.endswith(f"; fla refused: {said}")


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError(f"while running the backward: {FLA_HOPPER}"),  # not fla's own message: another error quoting it
    ValueError(FLA_HOPPER)])
def test_harness_logic_any_other_error_passes_the_fla_check_unchanged(error):
    from harness.runners.torch import fla_refusal

    with pytest.raises(type(error)) as raised, fla_refusal.refusal_as_unsupported():
        raise error
    assert raised.value is error


@pytest.mark.skipif(absent("torch"), reason="the HF model runner's rooms import torch")
@pytest.mark.parametrize("op", ["causal_lm", "causal_lm_train"])
def test_harness_logic_the_hf_model_runner_applies_the_fla_check_to_both_ops(monkeypatch, op):
    """A test double stands for the model's run (fla's refusal needs a Hopper GPU): the runner's entry point turns it
    into Unsupported for a forward and backward and for training."""
    from harness.runners import hf_model as entry
    from harness.runners.torch import hf_model, hf_train

    def refuses(request, phases):
        raise RuntimeError(FLA_HOPPER)
    monkeypatch.setattr(hf_train if op == "causal_lm_train" else hf_model, "run", refuses)
    with pytest.raises(Unsupported, match="flash-linear-attention needs Triton >= 3.7.1 or tilelang"):
        entry.run({"op": op}, None)
