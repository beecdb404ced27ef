"""The hf room (harness/runners/torch/hf_families.py) over every family: one contract, parametrized over the registry
of families (``FAMILIES``), instead of a copy per family. A family's own test file holds only what is its own (a
quirk: MiniMax-M2's partial factor, tests/test_minimax_m2.py). Each family is held to it in the interpreter its HF side
runs in: the harness's own (transformers 5.3.0), or the environment its hf.toml names (DeepSeek-V3.2: transformers
5.23.0), where the last test runs this file again."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import environments
from harness.case.registry import Registry
from harness.families import FAMILIES, Family
from harness.families.names import NameMap, expand_stack
from tests.support.installed import absent
from tests.support.model_case import model_request

pytestmark = pytest.mark.skipif(absent("torch", "transformers"), reason="the hf room builds transformers' models")

ROOT = Path(__file__).resolve().parents[1]
LOADED = ("same", "stack", "stack_cat0")  # the [hf.checkpoint] kinds hf_model's loader reads
# The families whose HF side runs in this interpreter (the others: in their environment, by the last test)
HERE = [name for name, family in FAMILIES.items() if environments.of_family(family) == environments.active()]
# Where each family's transformers returns the routing, in the release its HF side runs on (hf_families.routing)
ROUTING = {"deepseek_v3": "route_tokens_to_experts", "glm4_moe": "route_tokens_to_experts",
           "glm_moe_dsa": "route_tokens_to_experts", "qwen2_moe": "router_output", "qwen3_moe": "router_output",
           "minimax_m2": "router_output", "deepseek_v32": "router_output", "qwen3_5_moe": "router_output",
           "deepseek_v4": "router_output"}


def hash_moe_layers(types: list[str]):
    """How many leading hash layers DeepSeek-V4's mlp_layer_types holds (the schedule itself where it is no such)."""
    hashed = types.count("hash_moe")
    return hashed if types == ["hash_moe"] * hashed + ["moe"] * (len(types) - hashed) else types


# Keys a family gives under a legacy name that its transformers config folds into another (hf.toml says which):
# where the config keeps each
FOLDED = {"deepseek_v4": lambda config: {
    "compress_rate_csa": config.compress_rates["compressed_sparse_attention"],
    "compress_rate_hca": config.compress_rates["heavily_compressed_attention"],
    "num_hash_layers": hash_moe_layers(config.mlp_layer_types)}}


@pytest.fixture(scope="module")
def models() -> dict:
    """family name -> the typed config of its first model-level case (registry order): the cases' own 2-layer
    widths, so the contract sees what the runs see, with 8 routed experts, top-2 (a run of 384 experts takes a
    minute on a shared CPU)."""
    registry, found = Registry.load(), {}
    for case in registry.cases.values():
        if case.op == "causal_lm":
            found.setdefault(case.model.family, fewer_experts(case.model))
    assert set(found) == set(FAMILIES), f"a family without a model-level case: {set(FAMILIES) - set(found)}"
    return {name: m for name, m in found.items() if name in HERE}


def fewer_experts(m, experts: int = 8, topk: int = 2):
    """`m` with `experts` routed experts, top-`topk`: the keys its family's [architecture.moe] reads them from; a
    group-limited router (n_group > 1: DeepSeek-V3.2) keeps grouping, 4 groups of 2, the best 2."""
    moe = m.record.blueprint["moe"]
    keys = {moe["experts"].removeprefix("="): experts, moe["topk"].removeprefix("="): topk}
    if getattr(m, "n_group", 1) > 1:
        keys.update(n_group=4, topk_group=2)
    assert all(key.isidentifier() for key in keys), keys
    return m.record.config.resolve({**m.to_dict(), **keys})


def hf_model_of(m):
    """(transformers' model on the meta device, its config, its modeling module) as the runner builds it."""
    from harness.runners.torch import hf_families

    hf = hf_families.modeling(m)
    model, config = hf_families.build(hf, m)
    return model, config, hf


@pytest.mark.parametrize("family", HERE)
def test_names_cover_every_parameter_of_the_hf_model_and_every_canonical_one(models, family):
    """Each parameter and persistent buffer of transformers' model is named by the family's [hf.checkpoint] with a
    rule the loader reads, from canonical tensors only; and every canonical parameter of the family feeds one."""
    m = models[family]
    model, _, _ = hf_model_of(m)
    names = NameMap.load(family, "hf", model=m)
    canonical = {name for name, _, _ in FAMILIES[family].parameters(m)}
    used = set()
    for name in model.state_dict():
        rule = names.rule("checkpoint", name, m)
        assert rule.kind in LOADED, f"{family}: [hf.checkpoint] {name}: {rule.kind}"
        sources = [n for group in expand_stack(rule) for n in group] if rule.kind.startswith("stack") else \
            list(rule.sources)
        assert set(sources) <= canonical, f"{family}: {name} reads {set(sources) - canonical}"
        used.update(sources)
    assert used == canonical, f"{family}: canonical parameters no HF tensor reads: {sorted(canonical - used)[:5]}"


@pytest.mark.parametrize("family", HERE)
def test_the_hf_config_is_every_key_as_given(models, family):
    """transformers' config holds hf.toml's keys as the case gives them (none left to transformers' defaults), eager
    attention and experts, and RoPE settings as rope_parameters (a partial factor where the architecture rotates
    fewer dims than a head has)."""
    from harness.runners.torch import hf_families

    m = models[family]
    _, config, _ = hf_model_of(m)
    folded = FOLDED.get(family, lambda _: {})(config)
    for key in FAMILIES[family].stack("hf")["keys"]:
        value = getattr(m, key)
        held = folded[key] if key in folded else getattr(config, key)
        assert held == (list(value) if isinstance(value, tuple) else value), f"{family}: {key}"
    assert (config._attn_implementation, config._experts_implementation, config.use_cache) == ("eager", "eager", False)
    attention = FAMILIES[family].architecture(m).attention
    rope = config.rope_parameters
    if attention.kind == "compressed":  # DeepSeek-V4: a table per RoPE kind, the compressed layers' its "compress"
        assert (rope["main"]["rope_theta"], rope["compress"]["rope_theta"]) == (m.rope_theta, attention.rope_theta)
        assert {kind: (table["rope_type"], table["partial_rotary_factor"] * attention.head_dim)
                for kind, table in rope.items()} == {kind: ("default", attention.rotary_dim) for kind in rope}
        return
    assert rope["rope_theta"] == attention.rope_theta and rope == hf_families.rope_parameters(m)
    if attention.kind == "gqa":
        assert rope.get("partial_rotary_factor", 1.0) * attention.head_dim == attention.rotary_dim


@pytest.mark.parametrize("family", HERE)
def test_float64_mode_replaces_the_familys_islands_and_puts_hfs_back(models, family):
    """Inside: RMSNorm, the router and eager attention replaced, meta.json told each (and the RoPE tables and the
    loss); after: transformers' own back. Off: nothing replaced, nothing told. An island hf.toml's [float64_kept]
    names (DeepSeek-V4's router, attention and RoPE) stays HF's own, and meta.json says so with why."""
    from harness.runners.torch import hf_families

    m = models[family]
    spec = FAMILIES[family].stack("hf")
    kept = spec.get("float64_kept", {})
    hf = hf_families.modeling(m)
    islands = {"router": ((getattr(hf, spec["router"]), "forward"), f"{spec['router']}.forward"),
               "attention": ((hf, "eager_attention_forward"), "eager_attention_forward")}
    owners = [(getattr(hf, f"{spec['prefix']}RMSNorm"), "forward")] + [o for k, (o, _) in islands.items()
                                                                      if k not in kept]
    untouched = [o for k, (o, _) in islands.items() if k in kept]
    before, before_kept = [getattr(o, n) for o, n in owners], [getattr(o, n) for o, n in untouched]
    with hf_families.float64_mode(hf, m, on=False) as replaced:
        assert replaced == {} and [getattr(o, n) for o, n in owners] == before
    with hf_families.float64_mode(hf, m) as replaced:
        assert all(getattr(o, n) is not b for (o, n), b in zip(owners, before, strict=True))
        assert [getattr(o, n) for o, n in untouched] == before_kept
        made = {f"{spec['prefix']}RMSNorm.forward", *(label for k, (_, label) in islands.items() if k not in kept),
                *([] if "rope" in kept else [hf_families.rotary_class(m)]), "loss"}
        assert set(replaced) == made | {f"{island} (HF's own)" for island in kept}
        assert all("float64" in replaced[label] for label in made)
    assert [getattr(o, n) for o, n in owners] == before


def test_a_bad_hf_toml_is_refused_naming_the_file_the_field_and_the_value(tmp_path):
    from harness.runners.torch import hf_families

    folder = tmp_path / "qwen3_moe"
    shutil.copytree(FAMILIES["qwen3_moe"].folder, folder)
    path = folder / "hf.toml"
    path.write_text(re.sub(r'(?m)^router = .*$', "", path.read_text()))
    family = Family.load(folder)
    with pytest.raises(ValueError, match=re.escape(f"{path}: no 'router'")):
        hf_families.modeling(family.config())
    path.write_text(re.sub(r'(?m)^prefix = .*$', "", path.read_text()))
    family = Family.load(folder)
    with pytest.raises(ValueError, match=re.escape(f"{path}: no 'prefix'")):
        hf_families.model_class(family.config())


class DroppingConfig:
    """A test double of a transformers config class that drops the keys the room checks (``kept``) and the partial
    factor: the room's own refusal, no verdict."""

    def __init__(self, **given):
        self.__dict__.update({k: v for k, v in given.items()})
        self.rope_parameters = {k: v for k, v in given["rope_parameters"].items() if k != "partial_rotary_factor"}
        for key in FAMILIES[self.family].stack("hf").get("kept", ()):
            setattr(self, key, None)


@pytest.mark.parametrize("family", [f for f in HERE if FAMILIES[f].stack("hf").get("kept")
                                    or FAMILIES[f].stack("hf").get("partial_rotary_factor")])
def test_a_transformers_that_drops_a_key_is_refused(models, family):
    from harness.runners.torch import hf_families

    m = models[family]
    spec = FAMILIES[family].stack("hf")
    name = spec.get("config_class", f"{spec['prefix']}Config")
    fake = type("Modeling", (), {name: type(name, (DroppingConfig,), {"family": family})})
    with pytest.raises(RuntimeError, match=rf"transformers' {name} did not keep"):
        hf_families.hf_config(m, fake)


@pytest.mark.parametrize("family", HERE)
def test_a_float64_run_in_its_own_process_names_the_familys_model_knobs_and_routing(models, family, tmp_path):
    """The runner as the harness starts it: meta.json names transformers' class, the family's knobs from hf.toml, the
    float64 islands; a routing record for each MoE layer, nothing for a dense one."""
    from safetensors.numpy import load_file

    m = models[family]
    spec = FAMILIES[family].stack("hf")
    request = model_request(tmp_path, m.to_dict(), dtype="float64", tokens=8)
    done = subprocess.run([sys.executable, "-m", "harness.runners.hf_model", "--request", str(request)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    module = spec["module"]
    assert meta["implementation"].startswith(
        f"transformers.models.{module}.modeling_{module}.{spec['prefix']}ForCausalLM (HF transformers, torch)")
    assert {k: meta["knobs"][k] for k in spec.get("knobs", {})} == spec.get("knobs", {})
    router = "router (HF's own)" if "router" in spec.get("float64_kept", {}) else f"{spec['router']}.forward"
    assert router in meta["float64_mode"]
    moe = FAMILIES[family].moe_layers(m)
    assert list(meta["routing"]) == [f"layer {layer}" for layer in moe]
    outputs = load_file(str(tmp_path / "out" / "outputs.safetensors"))
    routed = sorted(int(n.split(".")[3]) for n in outputs if n.endswith(".mlp.gate.topk_indices"))
    assert routed == moe and all(outputs[f"module.model.layers.{layer}.mlp.gate.topk_indices"].shape[1] ==
                                 FAMILIES[family].architecture(m).moe.topk for layer in moe)


def on_disk(family: str, m):
    """canonical name -> its name in the family's released checkpoints ([disk.checkpoint]; the name itself where the
    family has no [disk] section): what transformers' from_pretrained reads."""
    from harness.families import ModelConfigError

    try:
        disk = NameMap.load(family, "disk", model=m)
    except ModelConfigError:
        return lambda name: name
    return lambda name: disk.rule("checkpoint", name).sources[0]


@pytest.mark.parametrize("family", HERE)
def test_transformers_own_loading_gives_the_name_maps_tensors_bit_for_bit(models, family, tmp_path):
    """The ecosystem's name map: transformers' ``from_pretrained`` applies its own conversion mapping
    (transformers/conversion_mapping.py: MiniMax-M2's block_sparse_moe renames, the routed experts fused into
    gate_up_proj and down_proj) to a checkpoint in the released names; hf_model's loader, through names.toml's
    [disk] and [hf.checkpoint], gives every tensor of the same model with the same name and the same bits."""
    import torch
    from safetensors.torch import save_file

    from harness.runners.torch import hf_families, hf_model

    m = models[family]
    record, generator = FAMILIES[family], torch.Generator().manual_seed(0)
    experts = record.routed_experts(m)  # a hash table (kind "hash") holds expert ids
    canonical = {name: torch.randint(0, experts, shape, generator=generator) if kind == "hash" else
                 torch.randn(shape, generator=generator) for name, shape, kind in record.parameters(m)}
    disk = on_disk(family, m)
    save_file({disk(name): tensor for name, tensor in canonical.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    hf = hf_families.modeling(m)
    model, config = hf_families.build(hf, m)
    config.save_pretrained(tmp_path)
    theirs = getattr(hf, hf_families.model_class(m)).from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    ours = hf_model._state_dict(model, canonical, NameMap.load(family, "hf", model=m), m, torch.float32,
                                {name for name, _ in record.buffers(m)})
    assert sorted(ours) == sorted(theirs)
    unequal = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not unequal, f"{family}: transformers loads other bits into {unequal[:5]}"


@pytest.mark.parametrize("family", HERE)
def test_the_routing_is_read_where_the_installed_transformers_returns_it(family, models):
    """transformers 5.3.0's grouped sigmoid MoE blocks return the routing from their route_tokens_to_experts, its
    softmax and MiniMax-M2 routers (and every router in 5.23.0) from the router's forward: read from the module."""
    from harness.runners.torch import hf_families

    assert hf_families.routing(hf_families.modeling(models[family])) == ROUTING[family]


@pytest.mark.slow
@pytest.mark.parametrize("name", environments.ENVIRONMENTS)
def test_the_contract_holds_for_the_families_of_each_environment(name):
    """This file again in the environment's interpreter, which selects the families whose HF side runs there."""
    families = [f for f, family in FAMILIES.items() if environments.of_family(family) == name]
    done = subprocess.run([environments.python(name), "-m", "pytest", __file__, "-n", "0", "-v", "-p",
                           "no:cacheprovider", "-m", "not slow"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert families and set(re.findall(r"\[(\w+)\] PASSED", done.stdout)) == set(families), done.stdout[-3000:]
