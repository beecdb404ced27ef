"""``compare CASE --versus impl=LEVEL``: the Paddle runner at the case's implementation level (side a) against itself
at LEVEL (side b), on the same inputs. The plumbing is tested with a stand-in level (tests/support/
paddle_level_double.py, a test double): each side gets its own ``config.paddle_impl``, the comparison names both and
which tensors differ, and no case expectation applies. One run compares two real levels."""

import pytest

from harness import CompareOptions, Versus, compare_case
from harness.compare.result import ERROR
from tests.support import paddle_level_double

pytest.importorskip("paddle")


def options(tmp_path, **fields):
    return CompareOptions(oracle=False, tokens=4, checkpoints_dir=tmp_path / "ckpt", reports_dir=tmp_path / "reports",
                          **fields)


@pytest.mark.e2e
def test_each_side_runs_its_own_level_on_the_same_inputs(tmp_path):
    python = paddle_level_double.interpreter(tmp_path)
    result, run_dir = compare_case("kimi_rmsnorm_recipe", options(tmp_path, versus=Versus("impl", "fp32_islands"),
                                                                  pythons={"paddle": python}))
    assert result.verdict == "DIFF", result.message
    by_label = {side.label: side for side in result.sides}
    assert [by_label[x].runner for x in "ab"] == ["paddle", "paddle"]
    assert by_label["a"].meta["paddle_level"] == "recipe" and by_label["b"].meta["paddle_level"] == "fp32_islands"
    assert "test double level" in by_label["b"].meta["implementation"]
    assert {t.name: t.mismatches for t in result.tensors} == {"out": 1, "grad.input": 0, "grad.weight": 0}
    assert result.comparison == {"kind": "paddle_impl", "runner": "paddle", "impl_a": "recipe",
                                 "impl_b": "fp32_islands", "equal": ["grad.input", "grad.weight"], "differ": ["out"]}
    assert "paddle at recipe vs fp32_islands: bitwise equal: grad.input, grad.weight; differ: out" in result.message
    assert result.expectation == {}  # not applied: the case's expectation is about its own two runners
    summary = (run_dir / "report.md").read_text()
    assert "paddle at implementation level recipe (side a) against level fp32_islands (side b)" in summary
    assert "bitwise equal: grad.input, grad.weight; differ: out" in summary


@pytest.mark.e2e
def test_two_real_levels_the_recipe_against_its_fp32_island_variant(tmp_path):
    """bf16 SwiGLU: the recipe rounds silu(gate) * up twice (PaddleFleet's order), the island once."""
    result, _ = compare_case("kimi_swiglu", options(tmp_path, versus=Versus("impl", "fp32_islands"),
                                                    config_overrides={"paddle_impl": "recipe"}))
    assert result.verdict == "DIFF", result.message
    assert {t.name for t in result.tensors if t.mismatches} == {"out", "grad.input"}
    sources = [side.meta["paddle_source"] for side in result.sides]
    assert "fused_bias_swiglu.py@d522e07b" in sources[0] and "seed PR's first revision" in sources[1]


@pytest.mark.parametrize("level, problem", [
    ("recipe", "--versus impl=recipe is side a's level already"),
    ("nonsense", "--versus impl must be one of auto, paddlefleet, paddleformers, recipe, fp32_islands"),
])
def test_a_level_that_cannot_be_compared_is_an_error_naming_it(tmp_path, level, problem):
    result, _ = compare_case("kimi_rmsnorm_recipe", options(tmp_path, versus=Versus("impl", level)))
    assert result.verdict == ERROR and problem in result.message and "kimi_rmsnorm_recipe" in result.message


def test_a_model_case_is_refused(tmp_path):
    result, _ = compare_case("kimi_k2_2layer", options(tmp_path, versus=Versus("impl", "recipe")))
    taken = "--versus impl: model-level cases take --versus batch, pad, cache, environment"
    assert result.verdict == ERROR and taken in result.message


def test_the_option_is_on_the_command_line():
    from harness.cli import main

    with pytest.raises(SystemExit) as raised:
        main(["compare", "kimi_rmsnorm", "--versus", "impl=nonsense"])
    assert raised.value.code == 2
