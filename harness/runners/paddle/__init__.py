"""PaddlePaddle (paddle only, plus PaddleFleet or PaddleFormers where they import).

``runner.py`` is the op-level entry; ``levels.py`` picks PaddleFleet (``fleet.py``), else PaddleFormers'
(``formers.py``), else the reference recipe (``recipe.py``: plain Paddle ops, not PaddleFleet; ``islands.py`` is its
FP32-island variant, pinned only); ``kernels.py`` asks Paddle which kernels exist here; ``guard.py`` turns what Paddle
says is a missing kernel into UNSUPPORTED; ``state.py`` puts back what a cell changes in the process; ``common.py`` is
what every level shares. ``model.py`` runs a whole model.
Adapters: ``paddlefleet_ops_shim.py`` stands in for PaddleFleet's GPU-only ``paddlefleet_ops`` package, which
PaddleFormers imports only to ask whether DeepEP exists (it answers no; named in meta.json). ``paddlefleet_shim.py``
puts a names-only ``paddlefleet`` (``paddlefleet_standin/``) on ``sys.path`` while a family's PaddleFormers model
module imports (GLM-4.5's imports PaddleFleet names for its PaddleFleet builder and never calls them), and takes it
away again (named in meta.json; tests/test_glm4_moe.py shows a run calls none of it).
"""
