"""Bitwise differential testing: does an op, a whole model or N training steps give the same bits in two stacks?

What a script uses (the rest of the package is internal and may move)::

    from harness import CompareOptions, Versus, compare_case
    result, run_dir = compare_case("kimi_shared_fc1", CompareOptions(tokens=16))
    result.verdict, result.exit_code, result.tensors

- ``compare_case`` / ``CompareOptions`` / ``Versus``: one comparison at any level (``harness.pipeline``);
- ``CaseResult``, ``VERDICTS``, ``EXIT_CODES``: what it gives (``harness.compare.result``);
- ``Registry``, ``CaseError``: the case registry (``cases/*.toml``);
- ``diff_dumps``: two dumps compared without running anything;
- capture inside your own training step: ``harness.capture.torch.capture`` / ``harness.capture.paddle.capture`` (each
  imports only its framework).

Names are loaded when first used, so a runner process that imports one small module of the package pays for
nothing else.
"""

import importlib

__version__ = "0.1.0"

_WHERE = {
    "compare_case": "harness.pipeline", "CompareOptions": "harness.pipeline", "Versus": "harness.levels",
    "CaseResult": "harness.compare.result", "VERDICTS": "harness.case.registry", "EXIT_CODES": "harness.compare.result",
    "Registry": "harness.case.registry", "CaseError": "harness.case.registry", "diff_dumps": "harness.commands.diff",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
