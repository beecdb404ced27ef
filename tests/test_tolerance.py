"""Tolerance policy: parsing (errors name file, case, field, value), decisions and margins, verdicts."""

import textwrap

import numpy as np
import pytest

from harness.case.registry import CaseError, Expectation
from harness.case.tolerance import Tolerance
from harness.compare.expectation import check_expectation
from harness.compare.result import CaseResult, decide
from harness.compare.tensors import compare_tensor
from harness.compare.tolerance import judge
from tests.support.cases import registry_from, tiny_case

CASE = tiny_case("fc1", seed=1, tokens=8, shapes={"input_size": 32, "output_size": 16})


def fc1_with(tmp_path, extra):
    """The registry of case fc1 with `extra` TOML lines added to its table."""
    return registry_from(tmp_path, CASE + textwrap.dedent(extra))


def test_shared_limits_and_per_tensor_overrides_merge(tmp_path):
    case = fc1_with(tmp_path, """
        [loose]
        base = "fc1"
        tolerance.max_ulp_at_scale = 16   # dotted keys: TOML forbids adding to an inline table
        tolerance.max_mismatch_share = 0.5
        tolerance.tensors."grad.weight" = { max_ulp = 4, max_mismatch_share = 1 }
        """).get("loose")
    assert case.tolerance.for_tensor("out") == {"max_ulp_at_scale": 16, "max_mismatch_share": 0.5}
    assert case.tolerance.for_tensor("grad.weight") == {"max_ulp_at_scale": 16, "max_mismatch_share": 1, "max_ulp": 4}
    assert case.expect.verdict == "WITHIN_TOLERANCE"  # stating a tolerance means accepting it
    assert fc1_with(tmp_path, "").get("fc1").tolerance is None  # bitwise by default


@pytest.mark.parametrize("table, field, value", [
    ("tolerance = { max_ulps = 3 }", "tolerance.max_ulps", "3"),
    ("tolerance = { max_ulp = -1 }", "tolerance.max_ulp", "-1"),
    ("tolerance = { max_ulp = 1.5 }", "tolerance.max_ulp", "1.5"),
    ("tolerance = { max_mismatch_share = 2 }", "tolerance.max_mismatch_share", "2"),
    ('tolerance = { max_ulp_at_scale = "8" }', "tolerance.max_ulp_at_scale", "'8'"),
    ("tolerance = { max_ulp_at_scale = true }", "tolerance.max_ulp_at_scale", "True"),
    ('tolerance.tensors."grad.wieght" = { max_ulp = 1 }', "tolerance.tensors.grad.wieght", "'max_ulp': 1"),
    ('tolerance.tensors."out" = { max_ulp = "x" }', "tolerance.tensors.out.max_ulp", "'x'"),
    ("tolerance = {}", "tolerance", "{}"),
    ("tolerance = 3", "tolerance", "3"),
    ('expect.verdict = "WITHIN_TOLERANCE"', "expect.verdict", "'WITHIN_TOLERANCE'"),
])
def test_bad_tolerance_fields_are_named(tmp_path, table, field, value):
    with pytest.raises(CaseError) as error:
        fc1_with(tmp_path, f'\n[bad]\nbase = "fc1"\n{table}\n')
    message = str(error.value)
    assert str(tmp_path / "family.toml") in message and "'bad'" in message
    assert f"field '{field}'" in message and value in message, message


def nudged(array, index, steps):
    """`array` with the element at `index` moved by `steps` ULPs."""
    out = array.copy()
    out.view(np.uint32)[index] += np.uint32(steps)
    return out


@pytest.fixture
def comparisons():
    """out: one element 3 ULPs off (max value 1.0, so tiny at scale); grad.input: equal; grad.weight: 8 off."""
    ones, ramp = np.ones((4, 4), np.float32), np.linspace(0.5, 1, 32, dtype=np.float32).reshape(4, 8)
    return [compare_tensor("out", nudged(ones, (0, 0), 3), ones),
            compare_tensor("grad.input", ramp, ramp.copy()),
            compare_tensor("grad.weight", nudged(ramp, (1, 1), 8), ramp)]


def test_within_when_every_limit_holds_with_margins(comparisons):
    verdict = judge(Tolerance({"max_ulp": 8, "max_mismatch_share": 0.1}), comparisons)
    assert verdict["within"]
    out = verdict["tensors"][0]
    assert [(c["limit"], c["measured"], c["margin"]) for c in out["checks"]] == [
        ("max_ulp", 3, 5), ("max_mismatch_share", 1 / 16, 0.1 - 1 / 16)]


def test_one_exceeded_limit_fails_and_names_it(comparisons):
    verdict = judge(Tolerance({"max_ulp": 8}, {"grad.weight": {"max_ulp": 4}}), comparisons)
    assert not verdict["within"]
    weight = verdict["tensors"][2]
    assert weight["checks"][0]["margin"] == -4 and weight["problems"] == ["max_ulp 8 > 4"]
    assert verdict["tensors"][0]["within"] and verdict["tensors"][1]["within"]


def test_tensor_without_a_limit_must_stay_bitwise(comparisons):
    verdict = judge(Tolerance({}, {"out": {"max_ulp": 3}}), comparisons)
    assert [t["within"] for t in verdict["tensors"]] == [True, True, False]
    assert "must be bitwise equal" in verdict["tensors"][2]["problems"][0]


def test_nan_on_one_side_is_never_within():
    ones = np.ones(4, np.float32)
    with_nan = ones.copy()
    with_nan[2] = np.nan
    verdict = judge(Tolerance({"max_mismatch_share": 1.0, "max_ulp": 10**9}), [compare_tensor("out", with_nan, ones)])
    assert not verdict["within"] and "NaN on one side only" in verdict["tensors"][0]["problems"][0]


def test_verdicts_and_exit_codes(comparisons):
    within = judge(Tolerance({"max_ulp": 8}), comparisons)
    beyond = judge(Tolerance({"max_ulp": 4}), comparisons)
    assert decide([], comparisons, tolerance=within)[0] == "WITHIN_TOLERANCE"
    verdict, message = decide([], comparisons, tolerance=beyond)
    assert verdict == "DIFF" and "beyond the case's tolerance: grad.weight: max_ulp 8 > 4" in message
    assert decide([], comparisons)[0] == "DIFF"  # no policy: bitwise
    result = CaseResult("run", "case", "cpu", verdict="WITHIN_TOLERANCE")
    result.expectation = check_expectation(Expectation("WITHIN_TOLERANCE"), "WITHIN_TOLERANCE", comparisons)
    assert result.exit_code == 0
    result.expectation = check_expectation(Expectation("BITWISE_PASS", stated=True), "WITHIN_TOLERANCE",
                                           comparisons)
    assert result.expectation["problems"] and result.exit_code == 1  # unexpected, so never 0


def test_bitwise_pass_meets_an_expected_tolerance(comparisons):
    equal = [comparisons[1]]
    assert check_expectation(Expectation("WITHIN_TOLERANCE"), "BITWISE_PASS", equal)["met"]
    assert not check_expectation(Expectation("WITHIN_TOLERANCE"), "DIFF", equal)["met"]
