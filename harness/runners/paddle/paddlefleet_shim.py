"""A stand-in for PaddleFleet's ``paddlefleet`` package, importable only while PaddleFormers' dygraph model modules
import on a CPU (``standing_in``). The stand-in is ``harness/runners/paddle/paddlefleet_standin/paddlefleet``: names
only (its ``__init__.py`` says which, and why each).

Why: PaddleFormers 1.2.0's ``glm4_moe/modeling.py`` (line 30) and ``qwen3_moe/modeling.py`` (line 45) import
``paddleformers.transformers.gpt_provider`` for their PaddleFleet builders; ``gpt_provider`` and ``model_provider``
raise ImportError unless ``importlib.util.find_spec("paddlefleet")`` finds a package with a location, then import a
handful of PaddleFleet names at module level. The dygraph classes the harness runs (``Glm4MoeForCausalLMDeprecated``,
``Qwen3MoeForCausalLMDeprecated``) use none of them. The real ``paddlefleet`` is on Paddle's own index, needs
paddlepaddle-gpu >= 3.3 and a GPU: where it imports, nothing here is installed.

Order matters: paddleformers' trainer, peft and quantization modules ask ``is_paddlefleet_available()`` at import
time and switch to PaddleFleet code paths when it answers True. So ``PRELOAD`` (paddleformers' own modules on the
model's import path) is imported first, without the stand-in; only then is the stand-in folder put on ``sys.path``,
for the import of the family's modeling module alone; afterwards the folder and every ``paddlefleet`` module are
taken out again (``sys.modules``), so ``find_spec("paddlefleet")`` answers None for the rest of the process (a later
cell of a worker sees no PaddleFleet). The modeling module keeps the stand-in names it bound; none is called during a
run (``calls()``; ``tests/test_glm4_moe.py``). The runner names it in ``meta.json`` ``adapters``
(``changes_computation: false``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "paddlefleet_standin"
MODULE = "paddlefleet"
# paddleformers' own modules that the dygraph model modules import and that must load while no paddlefleet is
# findable (measured: /tmp/zoo-research/paddle_tiny.py; they or what they import ask is_paddlefleet_available())
PRELOAD = ("paddleformers.transformers.model_utils", "paddleformers.transformers.configuration_utils",
           "paddleformers.nn.pp_model", "paddleformers.nn.criterion.interface",
           "paddleformers.nn.moe_deepep.moe_factory", "paddleformers.transformers.moe_gate",
           "paddleformers.transformers.moe_layer", "paddleformers.transformers.masking_utils",
           "paddleformers.transformers.auto.configuration")
ADAPTER = {
    "name": "paddlefleet stand-in (harness.runners.paddle.paddlefleet_shim)",
    "why": "PaddleFormers' modeling modules of the families built from their dygraph classes (each family's "
           "paddle.py) import gpt_provider, which refuses to import without a "
           "findable paddlefleet (PaddleFleet: GPU-only, not on PyPI) and then binds GPTModel, GPTConfig, gpt_builder, "
           "get_gpt_layer_local_spec, parallel_state, tensor_parallel, ModelType, FleetLayer, get_model_config for "
           "its PaddleFleet builders. The stand-in (harness/runners/paddle/paddlefleet_standin) defines those names "
           "only, each raising when called; it is findable only during that import. The dygraph *Deprecated model "
           "calls none of them (meta.json paddlefleet_stand_in_calls)",
    "changes_computation": False,
}
_ROOT: dict = {}  # the stand-in's root module once imported (its CALLS list), kept after it leaves sys.modules


def real_package_present() -> bool:
    module = sys.modules.get(MODULE)
    if module is not None:
        return not str(getattr(module, "__file__", "")).startswith(str(FOLDER))
    return importlib.util.find_spec(MODULE) is not None


@contextmanager
def standing_in() -> Iterator[dict | None]:
    """Inside: ``import paddlefleet`` finds the stand-in (unless the real package is there: then nothing changes and
    None is yielded); yields the adapter record. paddleformers' PRELOAD modules are imported first."""
    if real_package_present():
        yield None
        return
    for name in PRELOAD:
        importlib.import_module(name)
    sys.path.insert(0, str(FOLDER))
    importlib.invalidate_caches()
    try:
        yield ADAPTER
    finally:
        if MODULE in sys.modules:
            _ROOT.setdefault("module", sys.modules[MODULE])
        sys.path.remove(str(FOLDER))
        for name in [n for n in sys.modules if n == MODULE or n.startswith(MODULE + ".")]:
            del sys.modules[name]
        importlib.invalidate_caches()


def calls() -> list[str]:
    """The stand-in names called so far in this process ([] when the stand-in was never imported)."""
    module = _ROOT.get("module")
    return list(module.CALLS) if module is not None else []


def defined() -> dict[str, list[str]]:
    """{stand-in module: the public names it defines}, read from its files (what PaddleFormers may bind)."""
    import ast

    names = {}
    for path in sorted((FOLDER / MODULE).rglob("*.py")):
        module = ".".join(path.relative_to(FOLDER).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        found = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        found += [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
        names[module] = sorted(n for n in found if not n.startswith("_"))
    return names
