"""The Paddle side's level selection (harness.runners.paddle.levels) with named test doubles standing in for the
three level modules: auto takes the highest available level, a pin takes that level or is UNSUPPORTED naming it,
and every reason is kept. No framework is imported."""

from types import SimpleNamespace

import pytest

from harness.case import ops
from harness.run.protocol import Unsupported
from harness.runners.paddle import levels as paddle_levels


def fake_level(name, reason=None, covers=(ops.RMS_NORM,), import_problem=None):
    """Test double for a level module: an IMPLEMENTATIONS table of named stand-ins, a fixed `unavailable`, and its
    own import check of its package (`_import_problem`: None when the package imports)."""
    def implementation(*args):
        return {}, f"{name} stand-in"
    return SimpleNamespace(IMPLEMENTATIONS={op: implementation for op in covers},
                           unavailable=lambda request: reason, _import_problem=lambda: import_problem)


def loader(**levels):
    def load(level):
        if isinstance(levels[level], Exception):
            raise levels[level]
        return levels[level]
    return load


def installed(*packages):
    """Test double for `levels.installed`: exactly these packages are installed (default: all of them)."""
    return lambda package: not packages or package in packages


def choose(req, load, is_installed=None):
    return paddle_levels.choose(req, load, is_installed or installed())


def request(op="rms_norm", impl="auto"):
    return {"op": op, "device": "cpu", "dtype": "float32", "tp": 1,
            "config": ops.OPS[op].resolve({"paddle_impl": impl})}


def test_every_op_defaults_to_auto():
    assert all(op.resolve({})["paddle_impl"] == "auto" for op in ops.OPS.values())


def test_auto_takes_the_highest_available_level_and_keeps_why_the_others_were_passed_over():
    load = loader(paddlefleet=fake_level("paddlefleet", "no GPU"), paddleformers=fake_level("paddleformers"),
                  recipe=fake_level("recipe"))
    choice = choose(request(), load)
    assert choice.level == "paddleformers" and choice.implementation()[1] == "paddleformers stand-in"
    assert choice.meta()["paddle_levels_unavailable"] == {"paddlefleet": "no GPU"}
    assert choice.meta()["paddle_level_label"] == "PaddleFormers' module (not PaddleFleet)"


def test_auto_falls_to_the_recipe_when_a_level_is_not_installed_or_has_no_implementation():
    load = loader(paddlefleet=ImportError("never loaded: not installed"),
                  paddleformers=fake_level("paddleformers", covers=()), recipe=fake_level("recipe"))
    choice = choose(request(), load, installed("paddleformers"))
    assert choice.level == "recipe"
    assert choice.reasons["paddlefleet"].startswith("paddlefleet is not installed for ")
    expected = "no PaddleFormers' module (not PaddleFleet) implementation of op 'rms_norm'"
    assert expected in choice.reasons["paddleformers"]
    assert paddle_levels.LABELS["recipe"] == "reference recipe, not PaddleFleet"


@pytest.mark.parametrize("impl", ["auto", "paddleformers"])
def test_an_installed_level_that_does_not_import_is_an_error_naming_it(impl):
    """A broken install is never a quiet step down (auto) nor a skip (pinned): the old code took the recipe."""
    load = loader(paddlefleet=fake_level("paddlefleet", "PaddleFleet runs on a GPU only"),
                  paddleformers=fake_level("paddleformers", import_problem="ModuleNotFoundError: No module named "
                                                                           "'colorlog'"),
                  recipe=fake_level("recipe"))
    with pytest.raises(paddle_levels.BrokenLevel, match="PaddleFormers' module .*: paddleformers is installed but "
                                                        "does not import: ModuleNotFoundError: .*'colorlog'"):
        choose(request(impl=impl), load, installed("paddleformers"))


def test_a_level_module_of_the_harness_that_does_not_import_is_an_error():
    load = loader(paddlefleet=fake_level("paddlefleet", "GPU only"), paddleformers=SyntaxError("a bug"),
                  recipe=fake_level("recipe"))
    with pytest.raises(paddle_levels.BrokenLevel, match="harness module harness.runners.paddle.formers does not "
                                                        "import: SyntaxError: a bug"):
        choose(request(), load)


def test_the_survey_names_a_broken_level_and_runs_nothing():
    load = loader(paddlefleet=fake_level("paddlefleet", "GPU only"),
                  paddleformers=fake_level("paddleformers", import_problem="ImportError: broken"),
                  recipe=fake_level("recipe"), fp32_islands=fake_level("fp32_islands"))
    survey = paddle_levels.survey(request(), load, installed())
    assert survey["would_run"] is None and survey["broken"] == "paddleformers"
    assert survey["label"] == "ERROR: PaddleFormers' module (not PaddleFleet) is broken"
    assert survey["levels"]["paddleformers"].startswith(paddle_levels.BROKEN)
    assert survey["levels"]["recipe"] == "available"


def test_a_level_is_installed_when_python_finds_its_package(tmp_path, monkeypatch):
    """levels.installed asks importlib (find_spec): a package directory on the path is installed, broken or not."""
    (tmp_path / "harness_test_double_level").mkdir()
    (tmp_path / "harness_test_double_level" / "__init__.py").write_text("import a_missing_dependency\n")
    assert not paddle_levels.installed("harness_test_double_level")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert paddle_levels.installed("harness_test_double_level")


def test_a_pinned_level_runs_even_below_an_available_higher_one():
    load = loader(paddlefleet=fake_level("paddlefleet"), paddleformers=fake_level("paddleformers"),
                  recipe=fake_level("recipe"))
    assert choose(request(impl="recipe"), load).level == "recipe"


def test_a_pinned_level_that_is_missing_is_unsupported_naming_it():
    load = loader(paddlefleet=fake_level("paddlefleet", "PaddleFleet runs on a GPU only"),
                  paddleformers=fake_level("paddleformers"), recipe=fake_level("recipe"))
    with pytest.raises(Unsupported, match="config.paddle_impl = 'paddlefleet' pins PaddleFleet, which "
                                          "is unavailable here: PaddleFleet runs on a GPU only"):
        choose(request(impl="paddlefleet"), load)


def test_no_level_at_all_is_unsupported_with_every_reason():
    load = loader(paddlefleet=fake_level("paddlefleet", "a"), paddleformers=fake_level("paddleformers", "b"),
                  recipe=fake_level("recipe", "c"))
    with pytest.raises(Unsupported) as raised:
        choose(request(), load)
    assert all(f": {why}" in str(raised.value) for why in "abc")


def test_survey_lists_every_level_and_what_would_run():
    load = loader(paddlefleet=fake_level("paddlefleet", "no GPU"), paddleformers=fake_level("paddleformers"),
                  recipe=fake_level("recipe"), fp32_islands=fake_level("fp32_islands"))
    survey = paddle_levels.survey(request(), load, installed())
    assert survey == {"would_run": "paddleformers", "label": "PaddleFormers' module (not PaddleFleet)",
                      "levels": {"paddlefleet": "no GPU", "paddleformers": "available", "recipe": "available",
                                 "fp32_islands": "available"}}
    assert paddle_levels.survey(request(impl="paddlefleet"), load, installed())["would_run"] is None
    assert paddle_levels.survey(request(impl="fp32_islands"), load, installed())["would_run"] == "fp32_islands"


def test_auto_never_takes_the_fp32_island_variant_a_pin_does():
    load = loader(paddlefleet=fake_level("paddlefleet", "a"), paddleformers=fake_level("paddleformers", "b"),
                  recipe=fake_level("recipe", "c"), fp32_islands=fake_level("fp32_islands"))
    with pytest.raises(Unsupported, match="no Paddle implementation level is available here"):
        choose(request(), load)
    choice = choose(request(impl="fp32_islands"), load)
    assert choice.level == "fp32_islands" and "FP32 islands" in choice.meta()["paddle_level_label"]


def test_every_level_table_covers_the_catalogue_ops_it_claims_and_cites_its_source():
    """The level modules, read as text (importing them needs paddle): each has a table and `unavailable`, and
    the PaddleFleet level names the files and commits it was written against."""
    from pathlib import Path

    root = Path(paddle_levels.__file__).parent
    for module in paddle_levels.MODULES.values():
        text = (root / (module.rsplit(".", 1)[1] + ".py")).read_text()
        assert "IMPLEMENTATIONS = {" in text and "def unavailable(request" in text, module
    fleet = (root / "fleet.py").read_text()
    for cited in ("src/paddlefleet/transformer/paddle_norm.py", "src/paddlefleet/transformer/mlp.py",
                  "src/paddlefleet/fusions/fused_softmax.py", "src/paddlefleet/transformer/moe/moe_router.py",
                  "fused_bias_swiglu.py", "dot_product_attention.py", "multi_latent_attention.py",
                  "tensor_parallel/layers.py"):
        assert cited in fleet, cited
    assert fleet.count("@") >= 7  # a commit beside each file


def test_the_nightly_table_names_each_cases_paddle_level():
    from harness.report.nightly_report import paddle_level

    ran = {"sides": [{"label": "a", "runner": "megatron", "meta": {}},
                     {"label": "b", "runner": "paddle", "meta": {"paddle_level": "paddleformers"}}]}
    pinned = {"sides": [{"label": "b", "runner": "paddle", "meta": {
        "unsupported": "config.paddle_impl = 'paddlefleet' pins PaddleFleet, which is unavailable"}}]}
    assert paddle_level(ran) == "paddleformers" and paddle_level(pinned) == "pinned paddlefleet"
    assert paddle_level(None) == "—"


@pytest.mark.e2e
def test_pinning_paddlefleet_on_this_cpu_is_unsupported_with_the_reason(tmp_path):
    from harness import CompareOptions, compare_case

    result, run_dir = compare_case("kimi_rmsnorm", CompareOptions(
        runners=("paddle", "paddle"), oracle=False, tokens=4, config_overrides={"paddle_impl": "paddlefleet"},
        checkpoints_dir=tmp_path / "ckpt", reports_dir=tmp_path / "reports"))
    assert result.verdict == "UNSUPPORTED" and result.exit_code == 3
    assert "config.paddle_impl = 'paddlefleet' pins PaddleFleet, which is unavailable" in result.message
    assert "paddlefleet is not installed for " in result.message or "PaddleFleet runs on a GPU only" in result.message
