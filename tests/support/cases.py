"""Tiny case files for tests: one builder instead of a TOML string per test module.

`tiny_case()` is a float32 column-parallel linear small enough for any CPU in well under a second; every field
can be overridden or added (`tp=2`, `runners=["megatron", "megatron"]`, `perturb={...}`, ...).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from harness.case.registry import Registry

TINY = {"family": "linear", "op": "column_parallel_linear", "dtype": "float32", "seed": 3, "tokens": 4,
        "shapes": {"input_size": 8, "output_size": 4}}


def tiny_case(name: str = "tiny", **fields) -> str:
    """One case table in TOML; `fields` override or extend TINY (a field set to None is left out)."""
    table = {**({} if "base" in fields else TINY), **fields}
    lines = [f"[{name}]"] + [f"{key} = {_toml(value)}" for key, value in table.items() if value is not None]
    return "\n".join(lines) + "\n"


def model_case_table(model: dict, dtype: str = "float32", tokens: int = 16, seed: int = 1, **fields) -> str:
    """The case table `m` of op causal_lm for `model` (its config.model, `family` included; a nested table as a
    dict); `fields` as tiny_case takes them."""
    return tiny_case("m", family="model", op="causal_lm", dtype=dtype, seed=seed, tokens=tokens, shapes=None,
                     config={"model": model}, **fields)


def write_cases(folder: Path, *tables: str, file: str = "tiny.toml") -> Path:
    """`folder`/cases/`file` holding the tables; returns the cases folder."""
    cases = Path(folder) / "cases"
    cases.mkdir(parents=True, exist_ok=True)
    (cases / file).write_text("\n".join(textwrap.dedent(t) for t in tables))
    return cases


def registry_from(folder: Path, *tables: str) -> Registry:
    """The registry of `folder`/family.toml holding the tables."""
    (Path(folder) / "family.toml").write_text("\n".join(textwrap.dedent(t) for t in tables))
    return Registry.load(folder)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def _key(key: str) -> str:
    return key if key.replace("_", "").isalnum() else _toml(key)
