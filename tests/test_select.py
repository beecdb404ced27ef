"""`-k EXPRESSION` for list and nightly: pytest's grammar over a case's name, family and op."""

from types import SimpleNamespace

import pytest

from harness.case.registry import Registry
from harness.case.select import SelectError, select

CASES = [SimpleNamespace(name=n, family=f, op=o) for n, f, o in [
    ("kimi_shared_fc1", "linear", "column_parallel_linear"),
    ("kimi_shared_fc1_control_paddle", "linear", "column_parallel_linear"),
    ("kimi_rmsnorm", "norm", "rms_norm"),
    ("kimi_k2_2layer", "model", "causal_lm"),
]]


@pytest.mark.parametrize("expression, picked", [
    ("fc1", ["kimi_shared_fc1", "kimi_shared_fc1_control_paddle"]),
    ("fc1 and not control", ["kimi_shared_fc1"]),
    ("norm or model", ["kimi_rmsnorm", "kimi_k2_2layer"]),
    ("not (linear or norm)", ["kimi_k2_2layer"]),
    ("CAUSAL", ["kimi_k2_2layer"]),
    ("nothing_matches", []),
])
def test_expressions_pick_what_pytest_would(expression, picked):
    assert [c.name for c in select(CASES, expression)] == picked


@pytest.mark.parametrize("bad", ["", "fc1 and", "(fc1", "fc1 or or norm", "fc1 norm", ")"])
def test_a_broken_expression_is_refused_naming_it(bad):
    with pytest.raises(SelectError, match="-k"):
        select(CASES, bad)


def test_the_model_cases_alone_from_the_registry():
    picked = select(Registry.load().cases.values(), "causal_lm")
    assert picked and all("causal_lm" in (case.name + case.family + case.op) for case in picked)
