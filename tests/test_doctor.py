"""`python -m harness doctor` on this CPU, end to end: every runner is asked in its own interpreter; a missing
interpreter and a framework that does not import (test doubles) are listed with their reasons; the Paddle side names,
op by op and dtype by dtype, the level that would run and why each higher one is unavailable."""

import json
import sys

import pytest

from harness.case.registry import Registry
from harness.cli import main
from harness.families import FAMILIES
from tests.support.doubles import broken_install_python, fake_interpreter, missing_package_python


def torchless_python(folder):
    """Test double: this interpreter with a `torch` package first on its path whose import fails."""
    hidden = folder / "torchless_site" / "torch"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("No module named \'torch\' (hidden by a test double)")\n')
    return fake_interpreter(folder, "torchless_python",
                            f'#!/bin/sh\nPYTHONPATH="{hidden.parent}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')


def probeless_python(folder):
    """Test double: an interpreter whose runner answers as a runner without a probe does (its interpreter and host
    only, harness.run.protocol.probe_answer), whatever it is asked."""
    return fake_interpreter(folder, "probeless_python", '#!/bin/sh\necho \'{"runner": "oracle", "note": "this '
                            'runner answers no more than its interpreter and host"}\'\n')


def paddleformers_unsupported() -> list[str]:
    """The families, in registry order, whose cases state paddle_model UNSUPPORTED in float32 on a CPU (not the bf16
    kernels a CPU lacks): those PaddleFormers has no dygraph model of."""
    stated = {case.model.family for case in Registry.load().for_device("cpu") if case.model and case.dtype ==
              "float32" and "paddle_model" in case.runners and case.expect.verdict == "UNSUPPORTED"}
    return [name for name in FAMILIES if name in stated]


@pytest.fixture(scope="module")
def doctor(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doctor")
    answer = folder / "doctor.json"
    code = main(["doctor", "--device", "cpu", "--json", str(answer), "--python", "torch=/nonexistent/python",
                 "--python", f"torch_nn={torchless_python(folder)}", "--python", f"oracle={probeless_python(folder)}"])
    assert code == 0
    return json.loads(answer.read_text())


@pytest.mark.e2e
def test_unusable_runners_are_listed_with_the_reason(doctor):
    torch, torch_nn = doctor["runners"]["torch"], doctor["runners"]["torch_nn"]
    assert not torch["ok"] and "/nonexistent/python" in torch["reason"] and "cannot start" in torch["reason"]
    assert not torch_nn["ok"] and "hidden by a test double" in torch_nn["reason"]


@pytest.mark.e2e
def test_each_runner_answers_from_its_own_interpreter_with_versions_and_the_cpu(doctor):
    megatron, paddle, oracle = (doctor["runners"][r] for r in ("megatron", "paddle", "oracle"))
    assert megatron["ok"] and megatron["versions"]["megatron-core"] and megatron["torch_cpu_capability"]
    assert megatron["ops"]["rms_norm"]["would_run"].startswith("harness.runners.megatron.ops.")
    assert paddle["ok"] and paddle["versions"]["paddlepaddle"] and paddle["versions"]["paddleformers"]
    assert paddle["host"]["cpu_isa"] == doctor["harness"]["host"]["cpu_isa"]
    matmul = paddle["kernels"]["matmul"]
    assert matmul["float32"] == "ok" and "not registered" in matmul["bfloat16"]
    assert not oracle["ok"] and oracle["not_probed"] and "not probed" in oracle["reason"]  # the test double's


@pytest.mark.e2e
def test_the_model_runners_are_probed_and_never_ok_unasked(doctor, tmp_path):
    """Issue 29, finding 9: on an H200 host without Paddle the doctor said paddle_model "ok", and every model
    runner's row was "-": they had no probe, and an answer without one counted as ok. Each now imports what its run
    imports; a runner that answers its interpreter only is NOT PROBED (the oracle's test double above)."""
    megatron, hf, paddle = (doctor["runners"][r] for r in ("megatron_model", "hf_model", "paddle_model"))
    assert megatron["ok"] and megatron["versions"]["megatron-core"]
    assert "GPTModel" in megatron["ops"]["causal_lm"]["would_run"]
    assert "get_megatron_optimizer" in megatron["ops"]["causal_lm_train"]["would_run"]
    assert hf["ok"] and hf["versions"]["transformers"] and "DeepseekV3ForCausalLM" in hf["ops"]["causal_lm"][
        "would_run"]
    # DeepSeek-V3.2's and V4's HF side runs in its own environment (transformers 5.23.0), not this interpreter's 5.3.0
    assert hf["families_elsewhere"] == ["deepseek_v32: in the environment 'transformers-5.23.0'",
                                        "deepseek_v4: in the environment 'transformers-5.23.0'"], hf
    assert paddle["ok"] and paddle["versions"]["paddleformers"], paddle
    # a family PaddleFormers has no dygraph model of (its cases state paddle_model UNSUPPORTED in float32) is named
    # UNSUPPORTED, the runner stays usable
    assert [m.split(":")[0] for m in paddle["families_unsupported"]] == paddleformers_unsupported(), paddle
    assert "Glm4MoeForCausalLM" in paddle["ops"]["causal_lm"]["float32"]["would_run"]
    assert "DeepseekV3ForCausalLM" in paddle["ops"]["causal_lm_train"]["float32"]["would_run"]
    assert "not registered" in paddle["ops"]["causal_lm"]["bfloat16"]["reason"]  # no CPU bf16 matmul anywhere
    assert "whole models only" in megatron["ops"]["rms_norm"]["reason"]
    from harness.commands.doctor import probe

    answer = probe("paddle_model", missing_package_python(tmp_path, "paddle"), "cpu", 300)
    assert not answer["ok"] and not answer["broken"] and "paddle is not installed" in answer["reason"], answer


@pytest.mark.e2e
def test_paddle_names_the_level_for_every_op_and_why_the_others_are_unavailable(doctor):
    ops = doctor["runners"]["paddle"]["ops"]
    for op, by_dtype in ops.items():
        for dtype, survey in by_dtype.items():
            levels = survey["levels"]
            fleet = levels["paddlefleet"]  # not installed here; where it is, a CPU run is no place for it
            assert fleet.startswith("paddlefleet is not installed for ") or "GPU only" in fleet, (op, levels)
            assert survey["would_run"] in ("paddleformers", "recipe", None), (op, dtype, survey)
    assert ops["rms_norm"]["float32"]["would_run"] == "paddleformers"
    linear = ops["column_parallel_linear"]["bfloat16"]
    assert linear["would_run"] == "recipe" and "no bfloat16 matmul kernel on cpu" in linear["levels"]["paddleformers"]
    scaled = ops["swiglu+per_token_scale"]["float32"]
    assert scaled["would_run"] == "recipe" and "no SwiGLU times a per-token scale" in scaled["levels"]["paddleformers"]


@pytest.mark.e2e
def test_the_markdown_lists_every_op(doctor):
    from harness.report.doctor_report import markdown

    text = markdown(doctor)
    assert "## What would run, op by op" in text and "runner not usable" in text
    assert all(f"| {op} | bfloat16 |" in text for op in doctor["runners"]["paddle"]["ops"])


@pytest.mark.e2e
def test_a_broken_install_is_reported_broken_and_a_missing_one_not_usable(tmp_path):
    """Installed but not importing (a dependency of its own missing: test doubles) is BROKEN, whose cells would be
    ERRORs; not installed is not usable. The old doctor called both "not importable" and, for a PaddleFormers that
    does not import, answered ok with the recipe running instead."""
    from harness.commands import doctor
    from harness.report.doctor_report import markdown

    broken = doctor.run("cpu", {"megatron": broken_install_python(tmp_path, "megatron"),
                                "paddle": broken_install_python(tmp_path, "paddleformers")},
                        runners=("megatron", "paddle"))
    megatron, paddle = broken["runners"]["megatron"], broken["runners"]["paddle"]
    assert not megatron["ok"] and megatron["broken"], megatron
    assert megatron["reason"].startswith("megatron.core is installed for ") and "does not import" in megatron["reason"]
    assert not paddle["ok"] and paddle["broken"] and set(paddle["broken_levels"]) == {"paddleformers"}, paddle
    assert "paddleformers is installed but does not import" in paddle["reason"]
    assert paddle["ops"]["rms_norm"]["float32"]["would_run"] is None
    text = markdown(broken)
    assert "**megatron**" in text and "BROKEN (installed, does not import" in text
    assert "| rms_norm | float32 | runner broken | ERROR (broken level) |" in text
    missing = doctor.run("cpu", {"megatron": missing_package_python(tmp_path, "megatron")}, runners=("megatron",))
    megatron = missing["runners"]["megatron"]
    assert not megatron["ok"] and not megatron["broken"] and "is not installed" in megatron["reason"], megatron
    assert "NOT USABLE: megatron.core is not installed" in markdown(missing)
