"""Compare any two dumps tensor by tensor: safetensors files, folders of them, or folders of ``.npy`` files.

Users have dumps from real training runs (safetensors written by torch or Paddle, or ``np.save`` files that
alignment scripts write); they need the comparator without a runner. Tensors are loaded one pair at a time
(``safe_open`` per tensor), so memory stays near two tensors per comparing thread plus the comparator's chunk
temporaries, and the peak is measured with tracemalloc and reported. ``COMPARE_THREADS`` pairs are compared at once
(numpy releases the GIL in its passes over a tensor): a full-width model's 8.6 GB a side took 84 s to compare on one
core of the H200's host. Each pair's result depends on that pair alone, and the results keep the pairs' order.

Reading rules, chosen on purpose:
- In a folder, a tensor's name is its safetensors key, or for ``x/y.npy`` the path without suffix (``x/y``).
- ``np.save`` of an ml_dtypes bfloat16 array writes raw 2-byte records (numpy reads them back as ``|V2``):
  these are read as bfloat16. Paddle's ``.numpy()`` of a bf16 tensor gives uint16 bit patterns: say so with
  a dtype hint (``--as-dtype bfloat16`` or ``--as-dtype NAME=bfloat16``), which reinterprets integer arrays
  of the same width without conversion.
- A layout entry (``NAME=transpose``) brings side B's tensor into side A's layout (e.g. Paddle's [in, out]
  linear weight against Megatron's [out, in]); NAME is the name on side A.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import tomllib
from safetensors import safe_open

from harness import bits
from harness.compare.tensors import MISSING, TensorComparison, compare_tensor
from harness.resources import safetensors_keys

LAYOUTS = ("transpose",)
COMPARE_THREADS = min(8, os.cpu_count() or 1)  # pairs in memory at once, at most


class DumpError(ValueError):
    """A dump, a name map or an option that cannot be used; the message names the file, field and value."""


@dataclass
class Dump:
    """One side: where each tensor lives (a safetensors file and key, or an .npy file)."""

    path: Path
    files: dict[str, Path]  # tensor name -> file

    @classmethod
    def open(cls, path: Path) -> Dump:
        path = Path(path)
        if path.is_file():
            return cls(path, dict.fromkeys(safetensors_keys(path, DumpError), path))
        if not path.is_dir():
            raise DumpError(f"{path}: no such file or folder")
        files: dict[str, Path] = {}
        for file in sorted(path.rglob("*")):
            names = (safetensors_keys(file, DumpError) if file.suffix == ".safetensors"
                     else [file.relative_to(path).with_suffix("").as_posix()] if file.suffix == ".npy" else [])
            for name in names:
                if name in files:
                    raise DumpError(f"{path}: tensor {name!r} is in both {files[name]} and {file}")
                files[name] = file
        if not files:
            raise DumpError(f"{path}: holds no .safetensors or .npy files")
        return cls(path, files)

    def load(self, name: str) -> np.ndarray:
        file = self.files[name]
        try:
            if file.suffix == ".npy":
                array = np.load(file, allow_pickle=False)
                return array.view(ml_dtypes.bfloat16) if array.dtype == np.dtype("V2") else array
            with safe_open(str(file), framework="numpy") as handle:
                return handle.get_tensor(name)
        except (OSError, ValueError) as error:
            raise DumpError(f"{file}: tensor {name!r}: cannot be read: {error}") from None


def read_name_map(path: Path) -> dict[str, str]:
    """A JSON or TOML table {name in A: name in B}."""
    path = Path(path)
    try:
        text = path.read_text()
        table = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as error:
        raise DumpError(f"{path}: not a readable name map (JSON, or TOML for .toml): {error}") from None
    if not isinstance(table, dict):
        raise DumpError(f"{path}: a name map is a table of 'name in A' = 'name in B' (got {type(table).__name__})")
    for key, value in table.items():
        if not isinstance(value, str):
            raise DumpError(f"{path}: field {key!r}: expected the tensor's name in B as a string, got {value!r}")
    return table


def parse_assignments(items: list[str], option: str, allowed: tuple[str, ...], default_key: str | None = None):
    """'NAME=VALUE' options (or 'VALUE' alone where a default key exists) as a dict, each VALUE checked."""
    parsed = {}
    for item in items:
        key, sep, value = item.rpartition("=")
        if not sep and default_key is None:
            raise DumpError(f"{option}: expected NAME=VALUE, got {item!r}")
        key = key if sep else default_key
        if value not in allowed:
            raise DumpError(f"{option}: {item!r}: value {value!r} is not one of {', '.join(allowed)}")
        parsed[key] = value
    return parsed


def pair_names(a: Dump, b: Dump, name_map: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """(row name, name in A, name in B) for every tensor of either side; None where a side lacks it."""
    b_left = dict.fromkeys(b.files)
    pairs = []
    for name in a.files:
        b_name = name_map.get(name, name)
        pairs.append((name, name, b_name if b_name in b.files else None))
        b_left.pop(b_name, None)
    pairs += [(name, None, name) for name in b_left if name not in name_map.values()]
    pairs += [(name, None, None) for name in name_map if name not in a.files]
    return pairs


def compare_dumps(a: Dump, b: Dump, name_map: dict[str, str] | None = None, layouts: dict[str, str] | None = None,
                  dtype_hints: dict[str, str] | None = None) -> tuple[list[TensorComparison], dict]:
    """Every tensor pair compared, ``COMPARE_THREADS`` pairs in memory at a time; and the comparator's measured peak
    memory."""
    name_map, layouts, dtype_hints = name_map or {}, layouts or {}, dtype_hints or {}
    pairs = pair_names(a, b, name_map)
    for name in layouts:
        if name not in a.files:
            raise DumpError(f"--layout: {name!r} is not a tensor of {a.path}")
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()

    def one(pair: tuple[str, str | None, str | None]) -> tuple[TensorComparison, int]:
        row, a_name, b_name = pair
        if a_name is None or b_name is None:
            side, absent = (a, row) if a_name is None else (b, name_map.get(row, row))
            return TensorComparison(row, MISSING, note=f"{side.path} has no tensor {absent!r}"), 0
        hint = dtype_hints.get(row, dtype_hints.get("*"))
        left = _reinterpret(a.load(a_name), hint, a.files[a_name], a_name)
        right = _reinterpret(b.load(b_name), hint, b.files[b_name], b_name)
        if layouts.get(row) == "transpose":
            right = np.ascontiguousarray(np.swapaxes(right, -1, -2))
        return compare_tensor(row, left, right), max(left.nbytes, right.nbytes)

    try:
        with ThreadPoolExecutor(max_workers=COMPARE_THREADS, thread_name_prefix="compare") as pool:
            compared = list(pool.map(one, pairs))
        results = [result for result, _ in compared]
        largest = max((size for _, size in compared), default=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    memory = {"peak_traced_bytes": peak, "largest_tensor_bytes": largest,
              "peak_over_largest_tensor": round(peak / largest, 2) if largest else None,
              "measured_with": "tracemalloc (numpy allocations) over loading and comparing all pairs"}
    return results, memory


def _reinterpret(array: np.ndarray, hint: str | None, file: Path, name: str) -> np.ndarray:
    if hint is None or array.dtype.kind not in "iu":
        return array
    fmt = bits.format_of(hint)
    if array.dtype.itemsize != fmt.bits_dtype.itemsize:
        raise DumpError(f"{file}: tensor {name!r}: dtype hint {hint} needs {fmt.width}-bit integers, "
                        f"got {array.dtype.name}")
    return np.ascontiguousarray(array).view(fmt.float_dtype)
