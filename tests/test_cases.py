"""Registry loading and validation: every error names the file, the case, the field and the value."""


import pytest

from harness.case.registry import CaseError, Registry
from tests.support.cases import registry_from

GOOD = """
[fc1]
family = "linear"
op = "column_parallel_linear"
dtype = "bfloat16"
seed = 1
tokens = 8
shapes = { input_size = 32, output_size = 16 }

[fc1_fp32]
base = "fc1"
dtype = "float32"
tensors.weight = { std = 0.5 }
"""



def test_the_shipped_registry_loads_with_the_kimi_cases():
    registry = Registry.load()
    fc1 = registry.get("kimi_shared_fc1")
    assert (fc1.op, fc1.dtype, fc1.tp, fc1.shapes) == (
        "column_parallel_linear", "bfloat16", 1, {"input_size": 7168, "output_size": 4096})
    assert registry.get("kimi_shared_fc2").shapes == {"input_size": 2048, "output_size": 7168}
    assert registry.get("kimi_shared_fc1_fp32").dtype == "float32"


def test_base_inherits_and_tables_merge(tmp_path):
    case = registry_from(tmp_path, GOOD).get("fc1_fp32")
    assert case.dtype == "float32" and case.shapes == {"input_size": 32, "output_size": 16}
    assert case.tensors["weight"] == {"dist": "normal", "mean": 0.0, "std": 0.5}
    assert case.tensors["input"]["std"] == 1.0  # role default


def test_unknown_case_lists_close_names():
    with pytest.raises(CaseError, match=r"unknown case 'kimi_shared_fc3'.*did you mean: .*kimi_shared_fc1"):
        Registry.load().get("kimi_shared_fc3")


@pytest.mark.parametrize("edit, field, value", [
    (('dtype = "bfloat16"', 'dtype = "bf17"'), "dtype", "'bf17'"),
    (("output_size = 16", "output_size = 15"), "shapes.output_size", "15"),
    (("tokens = 8", "tokens = -1"), "tokens", "-1"),
    (("seed = 1", 'seed = "one"'), "seed", "'one'"),
    (('op = "column_parallel_linear"', 'op = "conv"'), "op", "'conv'"),
    (("seed = 1", "seed = 1\ncolour = 3"), "colour", "3"),
    (("seed = 1", "seed = 1\nconfig = { use_acuracy_compatible = true }"), "config.use_acuracy_compatible", "True"),
])
def test_bad_fields_are_named(tmp_path, edit, field, value):
    text = GOOD.replace(*edit).replace("[fc1]", "[fc1]\ntp = 2" if field == "shapes.output_size" else "[fc1]")
    with pytest.raises(CaseError) as error:
        registry_from(tmp_path, text)
    message = str(error.value)
    assert str(tmp_path / "family.toml") in message and "'fc1'" in message
    assert f"field '{field}'" in message and value in message, message


def test_shape_not_divisible_by_tp_says_so(tmp_path):
    text = GOOD.replace("[fc1]", "[fc1]\ntp = 4").replace("output_size = 16", "output_size = 18")
    with pytest.raises(CaseError, match=r"field 'shapes.output_size': must be divisible by tp=4 \(got 18\)"):
        registry_from(tmp_path, text)


def test_malformed_toml_names_the_file(tmp_path):
    with pytest.raises(CaseError, match=r"family.toml: malformed TOML"):
        registry_from(tmp_path, "[fc1\nop = 1")


def test_perturbation_index_must_fit_the_tensor(tmp_path):
    text = GOOD + '\n[bad]\nbase = "fc1"\nperturb = { side = "b", tensor = "input", index = [8, 0] }\n'
    with pytest.raises(CaseError, match=r"'bad': field 'perturb.index': must index into input of shape \[8, 32\]"):
        registry_from(tmp_path, text)


def test_a_control_swept_to_fewer_tokens_than_its_flip_needs_is_refused(tmp_path):
    """A sweep moves a negative control to other token counts: its planted flip must stay inside the tensor."""
    text = GOOD + '\n[control]\nbase = "fc1"\nperturb = { side = "b", tensor = "input", index = [5, 0] }\n'
    control = registry_from(tmp_path, text).get("control")
    assert control.with_tokens(6).tokens == 6
    with pytest.raises(CaseError, match=r"'control': field 'perturb.index': \[5, 0\] is outside input of shape "
                                        r"\[5, 32\] at tokens=5"):
        control.with_tokens(5)


def test_base_cycle_is_reported(tmp_path):
    with pytest.raises(CaseError, match="cycle"):
        registry_from(tmp_path, '[x]\nbase = "y"\n[y]\nbase = "x"\n')


def test_an_unknown_tensor_in_expect_names_the_closest_outputs_not_all_of_them(tmp_path):
    """A model or training case has thousands of outputs: the error names the closest few and the count."""
    with pytest.raises(CaseError) as raised:
        bad = '[fc1_bad]\nbase = "fc1"\nexpect = { verdict = "DIFF", differs = ["grad.weigth"] }\n'
        registry_from(tmp_path, GOOD + bad)
    message = str(raised.value)
    assert "fc1_bad" in message and "expect.differs" in message and "grad.weigth" in message
    assert "closest: grad.weight" in message and len(message) < 400, message


def test_truth_is_on_unless_a_case_turns_it_off(tmp_path):
    registry = registry_from(tmp_path, GOOD + '[fc1_no_truth]\nbase = "fc1"\ntruth = false\n')
    assert registry.get("fc1").truth and not registry.get("fc1_no_truth").truth
    with pytest.raises(CaseError, match="truth"):
        registry_from(tmp_path, GOOD + '[fc1_bad]\nbase = "fc1"\ntruth = "no"\n')
