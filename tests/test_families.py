"""The family registry and the contract every family meets, one test over every record (as PyTorch's OpInfo): the
folders are found, not listed; a family file's errors name the file, the field and the value; each family's typed
config resolves its real model's values, round-trips through the wire, refuses what it cannot model; its layout is
derived from its architecture. What each stack builds of it is tested over every family in that stack's tests."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from harness.families import DEFAULT, FAMILIES, Family, FamilyFileError, ModelConfigError, discover
from harness.families.expressions import ExpressionError, evaluate

FOLDER = Path(__file__).resolve().parents[1] / "harness" / "families"
EVERY = pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))


def test_a_family_folder_is_data_only():
    """No Python in a family's folder: each framework builds every family in its runner's room."""
    code = sorted(str(p.relative_to(FOLDER)) for p in FOLDER.glob("*/**/*") if p.suffix not in (".toml",)
                  and "__pycache__" not in p.parts and p.is_file())
    assert code == []


def test_every_family_folder_is_registered_default_first_then_by_name():
    folders = sorted(p.name for p in FOLDER.iterdir() if (p / "family.toml").is_file())
    assert list(FAMILIES) == [DEFAULT, *sorted(set(folders) - {DEFAULT})]
    for name, family in FAMILIES.items():
        assert isinstance(family, Family) and family.name == name and family.folder == FOLDER / name


def _copy(tmp_path: Path, *names: str, edit=None) -> Path:
    """A families folder under `tmp_path` holding copies of the named families' folders (``edit`` rewrites the first
    one's family.toml text)."""
    root = tmp_path / "families"
    for i, name in enumerate(names):
        target = root / f"{i}_{name}"
        shutil.copytree(FOLDER / name, target)
        if edit and i == 0:
            (target / "family.toml").write_text(edit((target / "family.toml").read_text()))
    return root


def test_a_folder_of_family_files_is_found_default_first(tmp_path):
    assert list(discover(_copy(tmp_path, "glm4_moe", "deepseek_v3"))) == [DEFAULT, "glm4_moe"]


def test_two_families_of_one_name_are_named(tmp_path):
    with pytest.raises(FamilyFileError, match="two families named 'glm4_moe'.*0_glm4_moe and .*1_glm4_moe"):
        discover(_copy(tmp_path, "glm4_moe", "glm4_moe"))


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda t: t.replace('[family]', '[family\n'), r"0_glm4_moe/family.toml: not TOML"),
    (lambda t: t.replace('kind = "gqa"', 'kind = "mqa"'),
     r"0_glm4_moe/family.toml: \[architecture.attention\] kind = 'mqa': must be one of \('gqa', 'mla', "
     r"'compressed'\)"),
    (lambda t: t.replace('heads = "=num_attention_heads"', 'heads = "=num_heads"'),
     r"0_glm4_moe/family.toml: \[architecture\] does not describe the default config: "
     r"'num_heads' names 'num_heads', which the config has not"),
    (lambda t: t.replace('heads = "=num_attention_heads"', 'heads = "=__import__(\'os\')"'),
     r"0_glm4_moe/family.toml: \[architecture\].*is not allowed in a family expression"),
])
def test_a_bad_family_file_names_the_file_field_and_value(tmp_path, edit, problem):
    with pytest.raises(FamilyFileError, match=problem):
        discover(_copy(tmp_path, "glm4_moe", edit=edit))


def test_expressions_compute_relations_and_refuse_code():
    names = {"h": 64, "n": 8, "layers": 4, "skip": (1,)}
    assert evaluate("h // n", names) == 8 and evaluate("'a' if h > n else 'b'", names) == "a"
    assert evaluate("[x for x in range(layers) if x not in skip]", names) == [0, 2, 3]
    assert evaluate("0 <= n <= h and all(x < layers for x in skip)", names) is True
    assert evaluate("[i for i in range(2) if kinds[i] == 'dense']", {"kinds": ["dense", "sparse"]}) == [0]
    assert evaluate("rope['theta'] * 2", {"rope": {"theta": 1.5}}) == 3.0
    for code in ("__import__('os')", "h.__class__", "open('f')", "lambda: 1",
                 "[x for x in range(2) for y in range(2)]", "skip[0:1]"):
        with pytest.raises(ExpressionError, match="is not allowed"):
            evaluate(code, names)
    with pytest.raises(ExpressionError, match="names 'width', which the config has not"):
        evaluate("width * 2", names)


@EVERY
def test_the_real_model_resolves_and_round_trips_through_the_wire(family):
    """The defaults are the real model's: they resolve unchanged, and the wire dict (JSON) reads back equal."""
    real = family.config.resolve({})
    assert real == family.config() and real.family == family.name
    wire = json.loads(json.dumps(real.to_dict()))
    assert wire["family"] == family.name and list(wire)[-1] == "family"
    assert family.config.from_dict(wire) == real
    assert dataclasses.is_dataclass(real) and dataclasses.fields(real)  # typed: one field per HF key


@EVERY
def test_a_config_is_refused_naming_key_and_value(family):
    first_int = next(f.name for f in dataclasses.fields(family.config) if f.type is int)
    cases = [({"nope": 1}, r"unknown key 'nope'; known: "),
             ({first_int: 2.5}, rf"{first_int} must be int \(got 2.5\)"),
             ({first_int: 0}, rf"{first_int} must be > 0 \(got 0\)")]
    cases += [({key: _other(allowed)}, rf"{key} must be one of .*\(got {_other(allowed)!r}\)")
              for key, allowed in family.config.rules.fixed.items()]
    for given, problem in cases:
        with pytest.raises(ModelConfigError, match=problem):
            family.config.resolve(given)
    with pytest.raises(ModelConfigError, match="unknown key 'nope'"):
        family.config.from_dict({"nope": 1})


@EVERY
def test_every_check_of_a_family_can_fail(family):
    """Each [[check]] of its family.toml refuses the config it says it refuses, with its own error."""
    assert family.config.rules.checks
    for holds, error, refuses in family.config.rules.checks:
        values = {**family.config().to_dict(), **refuses}
        with pytest.raises(ModelConfigError) as refused:
            family.config.resolve(refuses)
        assert str(refused.value) == error.format(**values), holds


def _other(allowed: tuple):
    """A value of the allowed values' type that is none of them."""
    kind = type(allowed[0])
    return not allowed[0] if kind is bool else "other" if kind is str else max(allowed) + 1


@EVERY
def test_the_layout_is_derived_from_the_architecture(family):
    """Parameters, gradients and modules agree with each other and the architecture at a small config: one embedding,
    per layer the attention and a dense or MoE MLP, the final norm and lm_head; a gradient for every trained tensor
    (an MLP's gate and up fused); buffers only where the architecture has a routing bias (not in a hash layer)."""
    m = family.config.resolve(_small(family))
    a = family.architecture(m)
    params = family.parameters(m)
    names = [name for name, _, _ in params]
    assert len(names) == len(set(names)) and names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    moe = a.moe_layers if a.moe else ()
    experts = sum(a.moe.experts for _ in moe) if a.moe else 0
    assert sum(".mlp.experts." in n and n.endswith("down_proj.weight") for n in names) == experts
    assert [n for n, _ in family.buffers(m)] == [
        f"model.layers.{layer}.{a.moe.expert_bias}.e_score_correction_bias" for layer in moe
        if layer not in a.moe.hash_layers] if a.moe and a.moe.expert_bias else family.buffers(m) == []
    detached = set(family.detached(m))  # an indexer's (DSA, DeepSeek-V4's CSA): the LM loss does not reach them
    assert detached == ({n for n in names if ".indexer." in n} if a.attention.indexer else set())
    trained = [n for n, _, kind in params if n not in detached and (kind not in ("buffer", "hash") and not (
        ".mlp." in n and n.endswith("up_proj.weight")) or n.endswith("gate_up_proj.weight"))]
    grads = {n.removeprefix("grad.") for n, _ in family.gradients(m)}
    assert grads == {n.replace("gate_proj", "gate_up_proj") if ".mlp." in n else n for n in trained}
    modules = [s.name for s in family.modules(m, 3)]
    assert modules[0] == "module.model.embed_tokens" and modules[-1] == "module.model.norm"
    assert sum(n.endswith(".mlp.gate.probs") for n in modules) == len(moe)
    assert family.dense_layers(m) == list(a.dense_layers) and family.moe_layers(m) == list(moe)


def _small(family: Family) -> dict:
    """A small config of `family`: its real model at 2 layers, narrow where the family's keys allow."""
    real = family.config().to_dict()
    small = {"num_hidden_layers": 2, "vocab_size": 64}
    if "mlp_layer_types" in real:  # one entry per layer
        small["mlp_layer_types"] = ["dense", "sparse"]
    if "layer_types" in real:  # one entry per layer: the real schedule's first two kinds (Qwen3.5-MoE: Gated
        small["layer_types"] = list(dict.fromkeys(real["layer_types"]))[:2]  # DeltaNet, attention; V4: HCA, CSA)
    for key, width in (("n_routed_experts", 4), ("num_experts", 4), ("num_local_experts", 4), ("num_hash_layers", 1),
                       ("num_experts_per_tok", 2), ("first_k_dense_replace", 1), ("n_group", 1), ("topk_group", 1)):
        if key in real:
            small[key] = width
    return small
