"""The Paddle room's one builder (harness/runners/paddle/families.py) over every family in the registry: the contract
(PaddleFormers' model built at the family's 2-layer case, each of its parameters named by the family's [paddle] name
map and every canonical parameter reached), what it tells meta.json, and the blocks it writes once (the routing made
again from a softmax router's logits, the float64 refusal, the missing dygraph model, the GPU path). A family's own
quirks stay in its own test file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from harness.case.registry import Registry
from harness.families import FAMILIES, model_config
from harness.run.protocol import Unsupported
from harness.runners.paddle import families as room
from tests.support.installed import absent
from tests.support.zoo import python_json

CASE = {"deepseek_v3": "kimi_k2_2layer"}  # the family's 2-layer case; the others are <family>_2layer


def two_layer_case(family: str) -> str:
    return CASE.get(family, f"{family}_2layer")


def tiny(family: str):
    """The family's typed config at its 2-layer case (the one the end-to-end runs use)."""
    return model_config(Registry.load().get(two_layer_case(family)).model)


def paddle_spec(name: str) -> dict:
    return FAMILIES[name].stack("paddle")


DYGRAPH = [name for name in FAMILIES if "no_dygraph_model" not in paddle_spec(name)]
NO_DYGRAPH = [name for name in FAMILIES if "no_dygraph_model" in paddle_spec(name)]
RECOMPUTED = [name for name in FAMILIES if "routing_lines" in paddle_spec(name)]


def test_the_registry_has_each_kind_of_family():
    """Negative control of the parametrization: each list below holds the families known to be of its kind (none
    emptied by a typo in a paddle.toml key); a new family joins one without an edit here."""
    assert {"deepseek_v3", "glm4_moe", "qwen2_moe", "qwen3_moe"} <= set(DYGRAPH)
    assert "minimax_m2" in NO_DYGRAPH and {"qwen2_moe", "qwen3_moe"} <= set(RECOMPUTED) <= set(DYGRAPH)


# --- the contract: PaddleFormers' model, every parameter named ------------------------------------------------------

CONTRACT = """
    import json, re, sys
    import numpy as np
    from harness.runners.paddle import paddlefleet_ops_shim
    paddlefleet_ops_shim.install()
    from harness.capture.paddle import apply_rule
    from harness.case.registry import Registry
    from harness.families import model_config
    from harness.families.names import NameMap
    from harness.runners.paddle import families
    from harness.runners.paddle.model import fresh_model
    def contract(case):
        m = model_config(Registry.load().get(case).model)
        model = fresh_model(m, "float32")
        name_map = NameMap.load(m.family, "paddle", model=m)
        canonical = {name: shape for name, shape, _ in m.record.parameters(m)}
        buffers = {name for name, _ in m.record.buffers(m)}
        targets = {n: p for n, p in model.named_parameters()}
        targets.update({n: b for n, b in model.named_buffers() if n in buffers})
        read, unfit = set(), {}
        for name, target in targets.items():
            rule = name_map.rule("checkpoint", name)
            missing = [s for s in rule.sources if s not in canonical]
            if missing:
                unfit[name] = f"{rule.kind} of {missing}: no canonical parameter"
                continue
            read.update(rule.sources)
            value = apply_rule(rule, [np.zeros(canonical[s], "float32") for s in rule.sources])
            if list(value.shape) != list(target.shape):
                unfit[name] = f"{rule.kind} gives {list(value.shape)}, the model holds {list(target.shape)}"
        # PaddleFormers' own conversion map of this class (_gen_aoa_config: "sources -> target, options"), at TP=1
        aoa = {}
        for statement in type(model)._gen_aoa_config(model.config)["aoa_statements"]:
            left, right = statement.split("->")
            target, *options = [part.strip() for part in right.split(",")]
            sources = [part.strip() for part in left.split(",")]
            pattern = re.escape(target).replace(re.escape("$LAYER_ID"), "(?P<L>[0-9]+)")
            pattern = pattern.replace(re.escape("$EXPERT_ID"), "(?P<E>[0-9]+)")
            for name in targets:
                found = re.fullmatch(pattern, name)
                if found:
                    filled = [src.replace("$LAYER_ID", found.groupdict().get("L") or "")
                              .replace("$EXPERT_ID", found.groupdict().get("E") or "") for src in sources]
                    flipped = {src.endswith("^T") for src in filled}
                    op = next((o for o in options if o in ("fused_qkv", "fused_ffn")), "")
                    kind = {("", False): "same", ("", True): "transpose", ("fused_qkv", True): "transpose_interleave",
                            ("fused_qkv", False): "interleave", ("fused_ffn", True): "cat0_transpose"}[
                        (op, flipped == {True})]
                    aoa[name] = (kind, [src.removesuffix("^T") for src in filled])
        differ = {}
        for name in targets:
            rule = name_map.rule("checkpoint", name)
            ours, theirs = (rule.kind, list(rule.sources)), aoa.get(name, ("same", [name]))
            if ours != theirs:
                differ[name] = {"ours": ours, "paddleformers": theirs}
        return {"parameters": len(targets), "unfit": unfit, "unread": sorted(set(canonical) - read),
                "class": type(model).__module__ + "." + type(model).__name__, "aoa": len(aoa), "differ": differ}
    print(json.dumps({case: contract(case) for case in sys.argv[1:]}))
"""


@pytest.fixture(scope="module")
def contracts():
    """CONTRACT for every dygraph family in one fresh interpreter: paddle and PaddleFormers imported once, not once per
    family (each model is built afresh from its own case, so one family's build cannot stand in for another's)."""
    return python_json(CONTRACT, *map(two_layer_case, DYGRAPH))


@pytest.mark.skipif(absent("paddle", "paddleformers"), reason="PaddleFormers' model (requirements-models.txt)")
@pytest.mark.parametrize("family", DYGRAPH)
def test_every_parameter_of_the_paddle_model_is_named_and_every_canonical_one_read(contracts, family):
    """PaddleFormers' model of the family, built at its 2-layer case: each parameter (and routing-bias buffer) comes
    from canonical checkpoint tensors by a [paddle.checkpoint] rule (or by its own name) in the model's shape, and
    every canonical parameter feeds one: nothing of the family is left out. The rules are, name by name, the ones
    PaddleFormers' own conversion map of the class (``_gen_aoa_config``) states at TP=1 (docs/model-contract.md)."""
    m = tiny(family)
    result = contracts[two_layer_case(family)]
    assert result["unfit"] == {} and result["unread"] == [], result
    assert result["parameters"] > 0
    # the [paddle.checkpoint] rules are PaddleFormers' own conversion map (_gen_aoa_config) at TP=1, name by name
    assert result["aoa"] > 0 and result["differ"] == {}, result["differ"]
    assert result["class"] == paddle_spec(family)["model_class"].replace(".deepseek_v3.", ".deepseek_v3.modeling.")
    assert room.model_name(m) == paddle_spec(family)["model_class"]


@pytest.mark.parametrize("family", NO_DYGRAPH)
def test_a_family_without_a_paddle_model_has_no_paddle_names(family):
    """No dygraph model: its names.toml says there is no [paddle] section, and the room refuses before building."""
    import tomllib

    assert "paddle" not in tomllib.loads(FAMILIES[family].names.read_text())
    assert room.knobs(tiny(family)) == {}


# --- what meta.json says --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", DYGRAPH)
def test_the_knobs_are_the_common_ones_then_the_familys_then_tp(family):
    """Every family's knobs, in meta.json's order: the room's common ones (reworded where the family's paddle.toml
    says), the family's own, the TP ones; each with why."""
    knobs = room.knobs(tiny(family))
    names = list(knobs)
    assert names[:len(room.KNOBS)] == list(room.KNOBS) and names[-len(room.TP_KNOBS):] == list(room.TP_KNOBS)
    assert "fd_fallback" in names and knobs["fd_fallback"][0] is False
    assert all(isinstance(why, str) and why for _, why in knobs.values())
    own = paddle_spec(family).get("knobs", {})
    assert all(knobs[name] == tuple(entry) for name, entry in own.items())


def test_the_knobs_keep_their_family_texts():
    """The texts that name a family's classes are the family's (paddle.toml), the others the room's."""
    assert room.knobs(tiny("qwen3_moe"))["fd_fallback"][1].endswith("not the fused 3-D Qwen3MoeExperts")
    assert room.knobs(tiny("glm4_moe"))["apply_rope_fusion"][1] == "the unfused rotary embedding (rotate_half on the " \
                                                                   "first rotary dims)"
    assert room.knobs(tiny("qwen2_moe"))["apply_rope_fusion"][1] == "the unfused rotary embedding (rotate_half)"
    assert list(room.knobs(tiny("glm4_moe")))[10:13] == ["num_nextn_predict_layers", "using_flex_token", "fd_fallback"]


@pytest.mark.parametrize("family", DYGRAPH)
def test_the_adapters_are_the_stand_in_where_imported_and_the_routing_record_where_remade(family):
    from harness.runners.paddle import paddlefleet_shim

    names = [a["name"] for a in room.adapters(tiny(family))]
    stand_in = paddle_spec(family).get("paddlefleet_stand_in") and not paddlefleet_shim.real_package_present()
    assert names == ([paddlefleet_shim.ADAPTER["name"]] if stand_in else []) + (
        ["routing record (harness/runners/paddle/families.py record_routing)"] if family in RECOMPUTED else [])


# --- the routing made again from a softmax router's logits ------------------------------------------------------------

@pytest.mark.parametrize("family", RECOMPUTED)
def test_paddle_routing_follows_the_blocks_own_lines(family):
    """record_routing makes the routing by the calls the family's MoE block makes (PaddleFormers 1.2.0): each line
    its paddle.toml cites is in the installed source of that block, in that order."""
    spec = importlib.util.find_spec("paddleformers")
    if spec is None:
        pytest.skip("PaddleFormers (requirements-models.txt) is not installed")
    module, start, end = paddle_spec(family)["routing_source"]
    source = (Path(spec.origin).parent / module).read_text()
    block = source[source.index(start):source.index(end)]
    lines = [" ".join(line.split("#")[0].split()) for line in block.splitlines()]
    wanted = paddle_spec(family)["routing_lines"]
    positions = [next((i for i, line in enumerate(lines) if line == want), None) for want in wanted]
    assert None not in positions, dict(zip(wanted, positions, strict=True))
    assert positions == sorted(positions)


@pytest.mark.parametrize("family", RECOMPUTED)
def test_paddle_routing_record_refuses_a_routing_the_experts_were_not_fed(family):
    """The check behind the recorded routing: each expert must have been fed the block's input rows at the tokens
    the indices send it, in (top-k slot, token) order; an idle expert one zero row. Anything else stops the run."""
    block = paddle_spec(family)["routing_source"][1].removeprefix("class ")
    hidden = np.arange(4 * 3, dtype=np.float32).reshape(1, 4, 3) + 1
    indices = np.array([[1, 0], [0, 1], [1, 2], [0, 1]])  # 4 tokens, top-2 of 4 experts (3 idle)

    def seen(changes=None):
        fed = {0: hidden[0, [1, 3, 0]], 1: hidden[0, [0, 2, 1, 3]], 2: hidden[0, [2]], 3: np.zeros((1, 3), "f4")}
        fed.update(changes or {})
        return {"input": hidden, "indices": indices, "weights": np.ones((4, 2), "f4"),
                **{f"fed {e}": rows for e, rows in fed.items() if rows is not None}}

    good = seen()
    room._check(good, 0, 4, block, None, None, None)
    assert set(good) == {"indices", "weights"}  # what the runner reads
    for bad in ({0: hidden[0, [0, 1, 3]]}, {2: None}, {3: np.ones((1, 3), "f4")}):
        with pytest.raises(RuntimeError, match=f"{block} fed it.*not the model's routing"):
            room._check(seen(bad), 0, 4, block, None, None, None)


# --- what a family cannot run -------------------------------------------------------------------------------------

def raised_in(path: str, function: str, message: str) -> Exception:
    """An error whose traceback has a frame of `function` in a file named `path` (a test double of PaddleFormers'
    refusal: the room reads only the frame's file and function and the message)."""
    code = compile(f"def {function}():\n    raise ValueError({message!r})\n", path, "exec")
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - a two-line function of this test's own text
    try:
        scope[function]()
    except ValueError as error:
        return error
    raise AssertionError("unreachable")


@pytest.mark.parametrize("family", [name for name in FAMILIES if "float64" in paddle_spec(name)])
def test_float64_refusal_in_the_moe_layer_is_unsupported_naming_it(family):
    """Raised in the family's MoE code in a float64 run: UNSUPPORTED with the family's why and the error's first line;
    the same error in float32, or raised elsewhere, is not explained (a crash stays a crash)."""
    refusal = paddle_spec(family)["float64"]
    m = tiny(family)
    message = f"The type of data we are trying to retrieve does not match the type of data ({family})\nmore"
    error = raised_in(f"/x/paddleformers/transformers/{refusal['file']}", refusal["function"], message)
    found = room.explain(error, {"dtype": "float64"}, m)
    assert isinstance(found, Unsupported) and "cannot run in float64" in str(found)
    assert f"does not match the type of data ({family})" in str(found) and "more" not in str(found)
    assert room.explain(error, {"dtype": "float32"}, m) is None
    elsewhere = raised_in("/x/paddleformers/transformers/other.py", refusal["function"], message)
    assert room.explain(elsewhere, {"dtype": "float64"}, m) is None


def test_deepseek_v3_explains_only_its_dtype_mismatch():
    """DeepSeek-V3's refusal is named by its message too: another error in the same function stays a crash."""
    error = raised_in("/x/deepseek_v3/modeling.py", "moe", "index out of range")
    assert room.explain(error, {"dtype": "float64"}, tiny("deepseek_v3")) is None


@pytest.mark.skipif(absent("paddleformers"), reason="reads PaddleFormers' installed source")
@pytest.mark.parametrize("family", NO_DYGRAPH)
def test_paddle_is_unsupported_naming_the_missing_dygraph_model(family):
    """PaddleFormers 1.2.0 exports only PaddleFleet builders for MiniMax-M2 and GLM-5 (its ForCausalLM and
    ForCausalLMPipe) and Qwen3.5-MoE (its ForConditionalGeneration, no Pipe), read from its source (the module does
    not import without PaddleFleet), and the message says so with the version."""
    from importlib.metadata import version

    found, builders, others = room.dygraph_classes(paddle_spec(family)["no_dygraph_model"])
    assert found == version("paddleformers")
    fleet = paddle_spec(family)["fleet"]
    if found == "1.2.0":
        pipe = [] if family == "qwen3_5_moe" else [fleet["model"] + "Pipe"]
        assert (sorted(builders), others) == (sorted([fleet["model"], *pipe]), [])
    with pytest.raises(Unsupported, match=f"{fleet['title']} has no dygraph model in PaddleFormers {found}: "
                                          ".*PaddleFleet builders"):
        room.classes(tiny(family))


@pytest.mark.skipif(not absent("paddlefleet"), reason="the GPU path's answer where paddlefleet is not installed")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_gpu_path_is_unsupported_naming_paddlefleet(family):
    with pytest.raises(Unsupported, match=r"paddlefleet is not installed.*[Ii]nstall paddlefleet and paddlefleet-ops"):
        room.fleet_model({"dtype": "float32"}, None, tiny(family))


def test_deepseek_v3_has_only_the_interleaved_rope():
    """Its quirk: no switch for rope_interleave (not passed to PaddleFormers); False is UNSUPPORTED."""
    m = tiny("deepseek_v3")
    assert "rope_interleave" not in room.config_kwargs(m) and "family" not in room.config_kwargs(m)
    with pytest.raises(Unsupported, match="rope_interleave = False: PaddleFormers' DeepseekV3 always de-interleaves"):
        room.config_kwargs(m.record.config.resolve({**m.to_dict(), "rope_interleave": False}))

