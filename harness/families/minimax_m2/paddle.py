"""MiniMax-M2 in Paddle: UNSUPPORTED on the CPU, naming why; the PaddleFleet path on a GPU, not run anywhere yet.

PaddleFormers 1.2.0 has no dygraph MiniMax-M2 model (/tmp/zoo-research/FINDINGS.md §3, ``paddle_minimax_probe.py``):
``paddleformers/transformers/minimax_m2/modeling.py`` exports only ``MiniMaxM2ForCausalLM`` and
``MiniMaxM2ForCausalLMPipe``, and both are PaddleFleet builders (``__new__`` -> ``GLMMoEModelProvider.from_config(
config).provide()``: PaddleFleet's ``GPTModel``); the module imports ``paddlefleet.transformer.utils`` unguarded at
line 19, so without PaddleFleet it does not even import, and with the names-only stand-in GLM-4.5 uses the build stops
at ``GLMMoEModelProvider.from_config`` (the stand-in has no builder). Unlike GLM-4.5 and Qwen3-MoE there is no
``*Deprecated`` dygraph class to fall back on. So ``classes`` raises Unsupported naming the feature (a dygraph
MiniMax-M2 in PaddleFormers) and the version, after reading the installed module's source (not importing it), so a
PaddleFormers that adds a dygraph class is reported as such instead. ``fleet_model`` names the GPU path: where
``paddlefleet`` imports, PaddleFormers' ``MiniMaxM2ForCausalLM`` builds PaddleFleet's model; it has not run anywhere
(no PaddleFleet here).

Everything else the runner asks (``BUILDER_API``) is defined from the family's layout, so the record is whole, but
nothing past ``classes`` runs.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from harness.families import FamilyConfig as MiniMaxM2Config
from harness.families import family_of
from harness.run.protocol import Phases, Unsupported, import_failure

_FAMILY = family_of('minimax_m2')  # transitional: the family's layout, until this builder moves to its room
gradients, modules, parameters = _FAMILY.gradients, _FAMILY.modules, _FAMILY.parameters

MODEL = "paddleformers.transformers.minimax_m2.modeling.MiniMaxM2ForCausalLM (a PaddleFleet builder)"
KNOBS = {}  # nothing is built on the CPU
MODULE = "transformers/minimax_m2/modeling.py"  # inside the paddleformers package


def adapters() -> list[dict]:
    """No stand-in is installed for this family (nothing is imported)."""
    return []


def classes():
    """UNSUPPORTED: PaddleFormers has no dygraph MiniMax-M2 model to run on the CPU (module docstring). The installed
    module's source is read, not imported (its module-level ``paddlefleet`` import fails without PaddleFleet)."""
    version, builders, others = dygraph_classes()
    if others:
        raise Unsupported(f"PaddleFormers {version} exports {', '.join(others)} in paddleformers/{MODULE}, a class "
                          "that may be a dygraph MiniMax-M2; the harness has no builder for it yet "
                          "(harness/families/minimax_m2/paddle.py)")
    raise Unsupported(
        f"MiniMax-M2 has no dygraph model in PaddleFormers {version}: paddleformers/{MODULE} exports only "
        f"{', '.join(builders) or 'nothing'}, PaddleFleet builders (__new__ -> GLMMoEModelProvider.from_config(config)"
        ".provide(), PaddleFleet's GPTModel), and no *Deprecated dygraph class as GLM-4.5 and Qwen3-MoE have; the "
        "Paddle side of MiniMax-M2 is PaddleFleet's model, on a GPU where paddlefleet imports (not available here)")


def dygraph_classes() -> tuple[str, list[str], list[str]]:
    """(PaddleFormers' version, the exported classes of its minimax_m2 modeling module that are PaddleFleet builders
    (they define ``__new__``), the exported classes that are not), read from the installed source."""
    spec = importlib.util.find_spec("paddleformers")
    if spec is None or not spec.submodule_search_locations:
        raise import_failure("paddleformers", ModuleNotFoundError("No module named 'paddleformers'"))
    from importlib.metadata import version

    path = Path(list(spec.submodule_search_locations)[0]) / MODULE
    if not path.is_file():
        raise Unsupported(f"PaddleFormers {version('paddleformers')} has no paddleformers/{MODULE} (no MiniMax-M2)")
    tree = ast.parse(path.read_text())
    exported = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)), [])
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    builders, others = [], []
    for name in exported:
        body = classes.get(name)
        if body is None:
            continue
        is_builder = any(isinstance(n, ast.FunctionDef) and n.name == "__new__" for n in body.body)
        (builders if is_builder else others).append(name)
    return version("paddleformers"), builders, others


def config_kwargs(m: MiniMaxM2Config) -> dict:
    """PaddleFormers' MiniMaxM2Config keys for the case's config (its names: n_routed_experts, moe_intermediate_size,
    rotary_dim): for the PaddleFleet path; nothing uses them on the CPU."""
    return {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "moe_intermediate_size": m.intermediate_size,
            "num_hidden_layers": m.num_hidden_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim,
            "n_routed_experts": m.num_local_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "rotary_dim": m.rotary_dim, "rope_theta": m.rope_theta, "rms_norm_eps": m.rms_norm_eps,
            "max_position_embeddings": m.max_position_embeddings, "use_qk_norm": m.use_qk_norm,
            "qk_norm_type": m.qk_norm_type, "scoring_func": m.scoring_func, "use_routing_bias": m.use_routing_bias,
            "n_shared_experts": 0, "first_k_dense_replace": 0, "use_mtp": False, "num_mtp_modules": 0}


def record_routing(model, m: MiniMaxM2Config) -> dict:
    """Never reached (``classes`` refuses first)."""
    raise Unsupported("no dygraph MiniMax-M2 model in PaddleFormers to record routing from")


def canonical_modules(m: MiniMaxM2Config) -> list[str]:
    """The contract's module paths in forward order (without "module.")."""
    return [s.name[len("module."):] for s in modules(m, 1)]


def canonical_grads(m: MiniMaxM2Config) -> list[str]:
    """The contract's gradient names (without "grad."), in forward order (the parameters', gate and up fused)."""
    wanted, names = {name[len("grad."):] for name, _ in gradients(m)}, []
    for name, _, _ in parameters(m):
        name = name.replace("gate_proj", "gate_up_proj")
        if name in wanted and name not in names:
            names.append(name)
    return names


def explain(error: Exception, request: dict) -> Unsupported | None:
    """Nothing runs, so nothing to explain."""
    return None


def fleet_model(request: dict, phases: Phases) -> dict:
    """PaddleFleet's MiniMax-M2 (PaddleFormers' MiniMaxM2ForCausalLM -> GLMMoEModelProvider), the Paddle side on a
    GPU. Nothing is built unless paddlefleet imports, and even then not: that path has not run anywhere yet."""
    try:
        import paddlefleet  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR
        failure = import_failure("paddlefleet", error)
        if not isinstance(failure, Unsupported):
            raise failure from error
        raise Unsupported(f"{failure}: the Paddle side of MiniMax-M2 is PaddleFormers' MiniMaxM2ForCausalLM, a "
                          "PaddleFleet builder (GLMMoEModelProvider); PaddleFormers has no dygraph MiniMax-M2. Install "
                          "paddlefleet and paddlefleet-ops (Paddle's package index) next to paddlepaddle-gpu >= 3.3") \
            from None
    # PaddleFormers 1.2.0 minimax_m2/modeling.py: MiniMaxM2ForCausalLM.__new__ -> GLMMoEModelProvider.from_config(
    # config).provide(loss_fn=...) with fuse_rms_norm forced True; its names would come from _gen_aoa_config (line
    # 497, the HF -> PaddleFleet map). A [paddlefleet] section of names.toml needs a built model to list.
    raise Unsupported("paddlefleet imports, but the PaddleFleet path of paddle_model for minimax_m2 has not been run "
                      "anywhere yet (see harness/families/minimax_m2/paddle.py); no verdict")
