"""Registry loading and validation: every error names the file, the case, the field and the value."""

import re
from pathlib import Path

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


def test_a_registry_is_parsed_again_only_when_its_text_changed(tmp_path):
    """A process going back and forth between folders (a test session) parses the shipped cases once and keeps the
    last few others (before: only the last folder's registry was kept, and going back parsed the 185 shipped cases
    again, ~3 s each time); a changed file is parsed again."""
    shipped = Registry.load()
    folders = [tmp_path / str(n) for n in range(6)]
    for folder in folders:
        folder.mkdir()
    others = [registry_from(folder, GOOD) for folder in folders]
    assert Registry.load() is shipped  # after more folders than the few kept
    assert Registry.load(folders[5]) is others[5] and Registry.load(folders[0]) is not others[0]
    changed = registry_from(folders[0], GOOD.replace("seed = 1", "seed = 2"))
    assert changed is not others[0] and changed.get("fc1").seed == 2


def test_threads_loading_one_folder_at_once_share_one_parse(tmp_path):
    """A night's cells load the registry from threads of their own: all at once, they get one registry, parsed once,
    and none fails (20 training cases: a parse of ~40 ms, which the threads all enter together without the lock)."""
    import threading

    from tests.support.cases import write_cases
    from tests.support.train import tiny_train_case

    folder = write_cases(tmp_path, *[tiny_train_case(f"t{n}") for n in range(20)])
    start, loaded = threading.Barrier(4), []
    threads = [threading.Thread(target=lambda: (start.wait(), loaded.append(Registry.load(folder)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loaded) == 4 and all(registry is loaded[0] for registry in loaded)


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


# --- expectations that say what a control claims ---------------------------------------------------------------

TRAIN = """
[t]
family = "train"
op = "causal_lm_train"
dtype = "float32"
seed = 1
tokens = 8
[t.config.model]
family = "deepseek_v3"
num_hidden_layers = 1
first_k_dense_replace = 1
hidden_size = 16
num_attention_heads = 2
num_key_value_heads = 2
q_lora_rank = 8
kv_lora_rank = 8
qk_nope_head_dim = 4
qk_rope_head_dim = 4
v_head_dim = 4
intermediate_size = 8
vocab_size = 32

[t.train]
steps = 2
"""


def _train_case(tmp_path, expect: str):
    return registry_from(tmp_path, TRAIN.replace("[t.config.model]", f"expect = {expect}\n\n[t.config.model]")).get("t")


def test_only_differ_and_bitwise_steps_say_exactly_which_tensors_differ(tmp_path):
    """Issue 29, finding 3: the training control said "step 1 bitwise, exactly two tensors at step 2" while its
    expectation named 7 tensors, so step-1 gradients that differ, or a flip leaking into other step-2 tensors, still
    met it. `bitwise_steps` and `only_differ` state it; a tensor beyond either fails the expectation."""
    from harness.compare.expectation import check_expectation
    from harness.compare.tensors import DIFF, EQUAL, TensorComparison

    case = _train_case(tmp_path, '{ verdict = "DIFF", bitwise_steps = [1], '
                                 'only_differ = ["step2.param.model.norm.weight"] }')
    assert case.expect.bitwise_steps == (1,) and case.expect.only_differ == ("step2.param.model.norm.weight",)
    names = [s.name for s in case.output_specs()]

    def run(differing):
        tensors = [TensorComparison(n, DIFF if n in differing else EQUAL) for n in names]
        return check_expectation(case.expect, "DIFF", tensors)

    assert run({"step2.param.model.norm.weight"})["met"]
    leaked = run({"step2.param.model.norm.weight", "step2.exp_avg.model.norm.weight"})
    assert not leaked["met"] and "1 more do: step2.exp_avg.model.norm.weight" in leaked["problems"][0]
    early = run({"step2.param.model.norm.weight", "step1.grad.lm_head.weight"})
    assert not early["met"] and early["problems"] == [
        "step 1 was expected bitwise equal; 1 tensors differ: step1.grad.lm_head.weight"]
    assert not run(set())["met"]  # the listed tensor must differ


def test_a_case_that_states_no_expectation_lists_no_expectation_problem(tmp_path):
    """Issue 40, finding 10: a case with no `expect` that gave DIFF listed "verdict DIFF, expected BITWISE_PASS" among
    report.json's expectation problems, though it expected nothing. It lists none; the verdict still exits 1."""
    from harness.compare.expectation import check_expectation
    from harness.compare.result import CaseResult
    from harness.compare.tensors import DIFF, EQUAL, TensorComparison

    registry = registry_from(tmp_path, GOOD + '\n[fc1_stated]\nbase = "fc1"\nexpect = { verdict = "BITWISE_PASS" }\n')
    differing = [TensorComparison("out", DIFF), TensorComparison("grad.input", EQUAL)]
    for name, verdict, problems, exit_code in (("fc1", "DIFF", [], 1), ("fc1", "BITWISE_PASS", [], 0),
                                               ("fc1_stated", "DIFF", ["verdict DIFF, expected BITWISE_PASS"], 1)):
        result = CaseResult("run", name, "cpu", verdict=verdict, tensors=differing)
        result.expectation = check_expectation(registry.get(name).expect, verdict, differing)
        report = result.to_dict()  # what report.json holds
        assert (report["expectation"]["problems"], report["exit_code"]) == (problems, exit_code), (name, verdict)


@pytest.mark.parametrize("expect, field, value", [
    ('{ bitwise_steps = [3] }', "expect.bitwise_steps", "3"),
    ('{ only_differ = [] }', "expect.only_differ", "[]"),
    ('{ only_differ = ["step2.nope"] }', "expect.only_differ", "step2.nope"),
    ('{ verdict = "DIFF", bitwise_steps = [1], only_differ = ["step1.loss"] }', "expect.only_differ", "step1.loss"),
    ('{ ranks_agree = "no" }', "expect.ranks_agree", "no"),
])
def test_exact_expectations_are_validated(tmp_path, expect, field, value):
    with pytest.raises(CaseError) as error:
        _train_case(tmp_path, expect)
    assert field in str(error.value) and value in str(error.value) and "'t'" in str(error.value)


CLAIMS = (  # what a control's comment may claim, and what its expectation must then state
    (re.compile(r"\b[Ss]tep (\d+) is bitwise"), lambda case, m: int(m.group(1)) in case.expect.bitwise_steps),
    (re.compile(r"\bat step (\d+) exactly"), lambda case, m: case.expect.only_differ is not None and {
        name.split(".")[0] for name in case.expect.only_differ} == {f"step{m.group(1)}"}),
    (re.compile(r"\bat step (\d+) the gradients differ, the output layer's"),
     lambda case, m: f"step{m.group(1)}.grad.lm_head.weight" in case.expect.differs),
)


def _comments_above(path) -> dict[str, str]:
    """{case name: the comment lines right above its table header}."""
    found, block = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            block.append(line.lstrip("# "))
        elif line.startswith("[") and not line.startswith("[["):
            found[line.strip("[] ")] = " ".join(block)
            block = []
        else:
            block = []
    return found


def test_every_control_comment_is_true_of_its_expectation():
    """A negative control's expectation states everything its comment claims (issue 29, finding 3): each claim the
    comment makes in a form of CLAIMS is backed by its expectation; a control whose comment says "exactly" states a
    complete expectation (only_differ, or differs and equal covering every output); a training control states its
    bitwise steps and what differs exactly, since one planted bit reaches a known set."""
    registry = Registry.load()
    comments = {}
    for path in sorted(Path("cases").glob("*.toml")):
        comments.update(_comments_above(path))
    controls = [case for case in registry.cases.values() if "control" in case.name]
    assert len(controls) >= 20
    for case in controls:
        comment = comments.get(case.name, "")
        assert case.expect.stated and case.expect.verdict in ("DIFF", "WITHIN_TOLERANCE"), case.name
        for pattern, backed in CLAIMS:
            for match in pattern.finditer(comment):
                assert backed(case, match), f"{case.name}: its comment claims {match.group(0)!r}; its expectation " \
                                            f"does not state it ({case.expect})"
        outputs = {spec.name for spec in case.output_specs()}
        complete = case.expect.only_differ is not None or set(case.expect.differs) | set(case.expect.equal) >= outputs
        if "exactly" in comment.lower() or case.op == "causal_lm_train":
            assert complete, f"{case.name}: its comment says 'exactly' but its expectation leaves tensors open"
        if case.op == "causal_lm_train":
            assert case.expect.bitwise_steps and case.expect.only_differ, case.name
