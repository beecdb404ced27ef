"""Named environments (harness/environments.py): which interpreter a side gets, the HF side of a family whose hf.toml
names one, UNSUPPORTED naming the package where it is not created, a bad name refused naming file, field and value;
and the environment `make` created: transformers 5.23.0 over this interpreter's packages (docs/model.md "Two
transformers")."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness import environments
from harness.case.registry import CaseError, Registry
from harness.families import FAMILIES, Family
from harness.run.orchestrate import SideSpec, side_python
from tests.support.cases import model_case_table

ROOT = Path(__file__).resolve().parents[1]
NAME = "transformers-5.23.0"


@pytest.fixture
def no_overrides(monkeypatch):
    for runner in ("HF_MODEL", "MEGATRON_MODEL", "TRUTH"):
        monkeypatch.delenv(f"HARNESS_PYTHON_{runner}", raising=False)


@pytest.fixture
def absent_environment(monkeypatch):
    """The environment as a folder that does not exist: a machine where `make` has not created it."""
    gone = environments.Environment(".venv-never-created", "requirements-hf523.txt", environments.ENVIRONMENTS[
        NAME].needs)
    monkeypatch.setitem(environments.ENVIRONMENTS, NAME, gone)


def test_deepseek_v32_and_v4_alone_name_an_environment():
    assert {name: environments.of_family(f) for name, f in FAMILIES.items() if environments.of_family(f)} == {
        "deepseek_v32": NAME, "deepseek_v4": NAME}


def test_the_hf_side_and_the_truth_of_such_a_family_get_its_interpreter_and_the_others_this_one(no_overrides):
    case = Registry.load().get("deepseek_v32_2layer_fp32_megatron")
    hf, truth = SideSpec("b", "hf_model", (), 1, "b"), SideSpec("oracle", "hf_model", (), 1, "o", truth=True)
    megatron = SideSpec("a", "megatron_model", (), 1, "a")
    here = environments.python(NAME)
    assert [side_python(case, side, {})[0] for side in (hf, truth, megatron)] == [here, here, sys.executable]
    kimi = Registry.load().get("kimi_k2_2layer_fp32")  # a family without one: this interpreter, as before
    assert [side_python(kimi, side, {})[0] for side in (hf, truth)] == [sys.executable, sys.executable]


def test_a_users_own_interpreter_wins_and_is_taken_as_it_is(no_overrides, absent_environment):
    case = Registry.load().get("deepseek_v32_2layer_fp32")
    hf, truth = SideSpec("a", "hf_model", (), 1, "a"), SideSpec("oracle", "hf_model", (), 1, "o", truth=True)
    assert side_python(case, hf, {"hf_model": "/mine/python"}) == ("/mine/python", "")
    assert side_python(case, truth, {"truth": "/mine/python"}) == ("/mine/python", "")
    assert side_python(case, hf, {})[1] != ""  # its own: the environment, which is missing


def test_a_missing_environment_makes_the_case_unsupported_naming_transformers_5_23(no_overrides, absent_environment,
                                                                                  tmp_path):
    """Nothing is started: both HF sides and the truth are UNSUPPORTED, the reason naming the package, the folder and
    how to create it; exit code 3."""
    from harness.pipeline.comparison import CompareOptions, compare_case

    result, run_dir = compare_case("deepseek_v32_2layer_fp32", CompareOptions(
        tokens=4, checkpoints_dir=tmp_path / "checkpoints", reports_dir=tmp_path / "reports"))
    report = json.loads((run_dir / "report.json").read_text())
    assert (result.verdict, result.exit_code) == ("UNSUPPORTED", 3), result.message
    assert [(s["label"], s["status"]) for s in report["sides"]] == [("a", "unsupported"), ("b", "unsupported"),
                                                                    ("oracle", "unsupported")]
    assert re.search(r"transformers 5\.23\.0 \(and tokenizers 0\.23\.1\) is not installed: the environment "
                     r"'transformers-5\.23\.0' \(\.venv-never-created, requirements-hf523\.txt\).*`make "
                     r"\.venv-never-created/\.installed` creates it", result.message), result.message
    assert not any((run_dir / s["folder"]).joinpath("stderr.log").exists() for s in report["sides"])


def test_a_bad_environment_name_is_refused_naming_the_file_the_field_and_the_value(tmp_path, monkeypatch):
    folder = tmp_path / "deepseek_v32"
    shutil.copytree(FAMILIES["deepseek_v32"].folder, folder)
    hf_toml = folder / "hf.toml"
    hf_toml.write_text(hf_toml.read_text().replace(f'environment = "{NAME}"', 'environment = "transformers-9.9"'))
    family = Family.load(folder)
    problem = re.escape(f"{hf_toml}: environment = 'transformers-9.9': not a known environment (known: {NAME})")
    with pytest.raises(ValueError, match=problem):
        environments.of_family(family)
    monkeypatch.setitem(FAMILIES, "deepseek_v32", family)  # and a case of it: refused when the registry loads it
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "m.toml").write_text(model_case_table(
        {"family": "deepseek_v32", "num_hidden_layers": 2, "first_k_dense_replace": 1}, tokens=4))
    with pytest.raises(CaseError, match=r"m\.toml: case 'm': field 'config\.model\.family': .*" + problem):
        Registry.load(tmp_path / "cases")


def test_the_environment_make_created_is_transformers_5_23_over_this_interpreters_packages():
    """`make` (or `python -m harness.environments transformers-5.23.0`) created .venv-hf523: its interpreter imports
    transformers 5.23.0 and tokenizers 0.23.1 from its own folder, torch from this interpreter's, and knows itself."""
    assert environments.missing(NAME) == "", environments.missing(NAME)
    code = ("import json, torch, tokenizers, transformers; from harness import environments; print(json.dumps("
            "[transformers.__version__, tokenizers.__version__, transformers.__file__, torch.__file__, "
            "environments.active()]))")
    done = subprocess.run([environments.python(NAME), "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    version, tokenizers, transformers_file, torch_file, active = json.loads(done.stdout.splitlines()[-1])
    assert (version, tokenizers, active) == ("5.23.0", "0.23.1", NAME)
    assert Path(transformers_file).is_relative_to(ROOT / ".venv-hf523")
    assert Path(torch_file).is_relative_to(sysconfig.get_path("purelib"))
    assert environments.active() is None  # this interpreter is the harness's own



def test_the_hf_room_in_an_interpreter_without_the_familys_model_says_unsupported_naming_it():
    """A user's own --python hf_model=... with transformers 5.3.0 for DeepSeek-V3.2: UNSUPPORTED, naming the module
    this transformers lacks and the environment the family names; never a crash (ERROR)."""
    from harness.run.protocol import Unsupported
    from harness.runners.torch import hf_families

    with pytest.raises(Unsupported, match=r"transformers 5\.3\.0 \(.*\) has no transformers\.models\.deepseek_v32\."
                                          r"modeling_deepseek_v32; the family's hf\.toml names the environment "
                                          r"'transformers-5\.23\.0' for it"):
        hf_families.modeling(FAMILIES["deepseek_v32"].config())


def test_versus_environment_puts_side_b_of_hf_model_in_the_named_environment(no_overrides):
    """``--versus environment=NAME`` (model cases): hf_model on both sides, side a in the family's own interpreter,
    side b in NAME; the report's comparison names both."""
    from harness.case.checkpoints import Checkpoint
    from harness.levels.base import Run, Versus
    from harness.levels.model import ModelLevel

    case = Registry.load().get("qwen3_moe_2layer_fp32")  # Megatron-Core against HF as written
    pair, comparison = ModelLevel().versus(case, Versus("environment", NAME))
    assert pair.runners == ("hf_model", "hf_model") and comparison == {
        "kind": "environment", "runner": "hf_model", "environment_a": None, "environment_b": NAME}
    run = Run(pair, Checkpoint(ROOT / "no-checkpoint", {}), "cpu", ROOT, {}, 60, Versus("environment", NAME))
    a, b = ModelLevel().sides(run)
    assert [side_python(pair, side, {})[0] for side in (a, b)] == [sys.executable, environments.python(NAME)]


@pytest.mark.parametrize("case, name, problem", [
    ("qwen3_moe_2layer_fp32", "transformers-9.9",
     r"qwen3_moe\.toml: case 'qwen3_moe_2layer_fp32': --versus: environment = 'transformers-9\.9': not a known "
     r"environment \(known: transformers-5\.23\.0\)"),
    ("deepseek_v32_2layer_fp32", NAME, r"--versus environment=transformers-5\.23\.0 is side a's already"),
    ("kimi_shared_fc1", NAME, r"--versus environment: op-level cases take --versus tp, impl, batch"),
])
def test_versus_environment_refuses_a_bad_name_side_as_own_and_other_levels(case, name, problem):
    from harness.levels import level_of
    from harness.levels.base import Versus

    found = Registry.load().get(case)
    with pytest.raises(CaseError, match=problem):
        level_of(found).versus(found, Versus("environment", name))


@pytest.mark.slow
@pytest.mark.e2e
def test_did_upgrading_transformers_change_qwen3_moes_bits_in_float32(tmp_path, checkpoints_dir):
    """The two releases on one command: Qwen3-MoE's 2-layer fp32 model on 5.3.0 (side a) and 5.23.0 (side b) give the
    same bits in every one of its 563 tensors (the bf16 case does not run: 5.23.0's router returns bf16 routing
    weights, docs/model.md)."""
    from conftest import E2E_TOKENS
    from harness import CompareOptions, compare_case
    from harness.levels.base import Versus

    result, run_dir = compare_case("qwen3_moe_2layer_fp32", CompareOptions(
        tokens=E2E_TOKENS, checkpoints_dir=checkpoints_dir, reports_dir=tmp_path / "reports", oracle=False,
        versus=Versus("environment", NAME)))
    report = json.loads((run_dir / "report.json").read_text())
    assert (result.verdict, len(result.tensors)) == ("BITWISE_PASS", 563), result.message
    assert [s["meta"]["versions"]["transformers"] for s in report["sides"]] == ["5.3.0", "5.23.0"]
    assert "against transformers-5.23.0 (side b: transformers 5.23.0)" in (run_dir / "report.md").read_text()


def test_a_refeed_of_side_b_runs_in_side_bs_environment(monkeypatch, tmp_path):
    """--versus environment with --refeed: side b's replay starts in side b's environment, not the family's. A test
    double of run_sides records the side it is given (the harness's own logic; no verdict)."""
    from harness.compare import model_refeed

    seen = []
    monkeypatch.setattr(model_refeed.orchestrate, "run_sides", lambda case, sides, *rest: seen.extend(sides) or [0])
    case = Registry.load().get("qwen3_moe_2layer_fp32")
    spec = SideSpec("b", "hf_model", (), 1, "b-hf_model", environment=NAME)
    assert model_refeed._side(case, {}, spec, "refeed", tmp_path, "cpu", {}, 60) == 0
    assert [side.environment for side in seen] == [NAME]
