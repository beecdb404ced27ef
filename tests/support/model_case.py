"""A ``causal_lm`` request for any model family, its checkpoint made by the harness itself (a one-case registry, then
``harness.case.checkpoints.prepare``): what a runner test needs to start a model runner in its own process on a
tiny config without writing the family's tensor list again."""

from __future__ import annotations

import json
from pathlib import Path

from harness.case.checkpoints import prepare
from tests.support.cases import model_case_table, registry_from


def model_case(folder: Path, model: dict, dtype: str = "float32", tokens: int = 16, seed: int = 1, **fields):
    """The case `m` of op causal_lm for `model` (its config.model, `family` included), in `folder`."""
    return registry_from(folder, model_case_table(model, dtype, tokens, seed, **fields)).get("m")


def model_request(folder: Path, model: dict, dtype: str = "float32", tokens: int = 16, seed: int = 1) -> Path:
    """request.json (and the checkpoint it names) for `model` in `folder`; returns its path. The output folder is
    `folder`/out."""
    folder = Path(folder)
    case = model_case(folder, model, dtype, tokens, seed)
    checkpoint = prepare(case, root=folder / "checkpoints")
    request = {"schema": 1, "case": case.name, "op": case.op, "dtype": case.dtype, "device": "cpu", "tp": 1,
               "tokens": case.tokens, "shapes": case.shapes, "config": case.config, "seed": case.seed,
               "checkpoint": [str(path.resolve()) for path in checkpoint.files],
               "output_dir": str((folder / "out").resolve())}
    path = folder / "request.json"
    path.write_text(json.dumps(request))
    return path
