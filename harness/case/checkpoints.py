"""Shared weights, inputs and upstream gradients: generated deterministically or imported, then verified.

Layout: ``checkpoints/<case>/<digest>/inputs.safetensors`` plus ``manifest.json`` (sha256 per tensor,
the recipe that made it, generator version). The digest covers every input to the bits, so a folder
is reused exactly when the same tensors would be generated again; it is verified on every load, and
a mismatch is an error: the harness never regenerates over a file someone may have edited on purpose.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors loads it)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from harness import paths, resources
from harness.bits import format_of
from harness.case.ops import MODEL_OPS, resolve_dtype
from harness.case.registry import Case

GENERATOR_VERSION = 1
CHECKPOINTS_DIR = Path(__file__).resolve().parents[2] / "checkpoints"
MANIFEST = "manifest.json"
INPUTS = "inputs.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or built; the message names the file and tensor."""


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    manifest: dict

    @property
    def path(self) -> Path:
        return self.folder / INPUTS

    def path_for(self, side: str) -> Path:
        """The inputs a side reads: the shared file, or its perturbed copy for a negative control."""
        perturbed = self.manifest.get("perturbed")
        if perturbed and perturbed["side"] == side:
            return self.folder / perturbed["file"]
        return self.path


def prepare(case: Case, root: Path = CHECKPOINTS_DIR, weights_file: str | None = None) -> Checkpoint:
    """Return the verified checkpoint of `case`, creating it on first use."""
    check_memory(case)
    imported = _imports(case, weights_file)
    recipe = _recipe(case, imported)
    made = _digest(recipe)
    try:
        folder = paths.child(paths.child(Path(root), case.name, "case"), made, "checkpoint")
    except paths.UnsafeName as error:
        raise CheckpointError(f"{error}; the checkpoint must stay inside {root}") from None
    if not (folder / MANIFEST).exists():
        with resources.boundary("checkpoint", folder):
            _write(case, folder, recipe, made, imported)
    manifest = verify(folder)
    if manifest.get("digest") != made:
        raise CheckpointError(f"{folder / MANIFEST}: field 'digest' is {manifest.get('digest')!r}, "
                              f"but the folder name and the case say {made!r}")
    return Checkpoint(folder, manifest)


def digest(case: Case, weights_file: str | None = None) -> str:
    """The digest of `case`'s checkpoint without making it: what a baseline's record of the case is checked against."""
    return _digest(_recipe(case, _imports(case, weights_file)))


def _imports(case: Case, weights_file: str | None) -> dict[str, tuple[np.ndarray, dict]]:
    if case.op in MODEL_OPS and weights_file:
        return _import_model_weights(case, weights_file)
    return _import_weights(case, weights_file) if case.weights_from else {}


def _digest(recipe: dict) -> str:
    """Names the bytes, not where they were read: an imported tensor counts by its sha256, so two clones (or two
    virtual environments) holding the same weights at different paths make one checkpoint and one baseline digest."""
    imported = {name: {k: v for k, v in source.items() if k != "file"} for name, source in recipe["imported"].items()}
    return hashlib.sha256(json.dumps({**recipe, "imported": imported}, sort_keys=True).encode()).hexdigest()[:16]


def verify(folder: Path) -> dict:
    """Check every file and tensor against the manifest; return the manifest."""
    manifest_path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {error}") from None
    _check_manifest(manifest, manifest_path)
    files = {INPUTS: manifest["tensors"]}
    if manifest.get("perturbed"):
        files[manifest["perturbed"]["file"]] = manifest["perturbed"]["tensors"]
    for file_name, expected in files.items():
        try:
            file = paths.child(Path(folder), file_name, "checkpoint file")
        except paths.UnsafeName as error:
            raise CheckpointError(f"{manifest_path}: {error}; delete {folder} to regenerate it") from None
        tensors = load_tensors(file)
        if set(tensors) != set(expected):
            raise CheckpointError(f"{Path(folder) / file_name}: holds tensors {sorted(tensors)}, "
                                  f"manifest lists {sorted(expected)}")
        for name, entry in expected.items():
            actual = tensor_sha256(tensors[name])
            if actual != entry["sha256"]:
                raise CheckpointError(
                    f"{Path(folder) / file_name}: tensor {name!r} has sha256 {actual[:16]}..., manifest "
                    f"{manifest_path} says {entry['sha256'][:16]}...: the file was changed or corrupted. "
                    f"Delete {folder} to regenerate it.")
    return manifest


MANIFEST_KEYS = {"digest": str, "generator_version": int, "tensors": dict}


def _check_manifest(manifest, path: Path) -> None:
    """Every key the harness reads, of the right type: a hand-edited manifest fails here, naming the key."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: manifest must be a JSON object (got {type(manifest).__name__})")
    for key, kind in MANIFEST_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            problem = "is missing" if key not in manifest else f"must be {kind.__name__} (got {manifest[key]!r:.60})"
            raise CheckpointError(f"{path}: key {key!r} {problem}; delete {path.parent} to regenerate it")
    entries = [manifest["tensors"]]
    perturbed = manifest.get("perturbed")
    if perturbed is not None:
        if not (isinstance(perturbed, dict) and isinstance(perturbed.get("file"), str)
                and isinstance(perturbed.get("tensors"), dict) and isinstance(perturbed.get("side"), str)):
            raise CheckpointError(f"{path}: key 'perturbed' must hold 'side', 'file' and 'tensors'; "
                                  f"delete {path.parent} to regenerate it")
        entries.append(perturbed["tensors"])
    for tensors in entries:
        for name, entry in tensors.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
                raise CheckpointError(f"{path}: tensor {name!r} has no 'sha256'; delete {path.parent} to "
                                      "regenerate it")


def check_memory(case: Case) -> None:
    """Refuse, with the size it would need, a case whose tensors cannot fit in memory (before making any). A training
    case's outputs count one step: each side writes, and the comparator reads, one step at a time."""
    outputs = [spec for spec in case.output_specs() if not spec.name.startswith("step") or
               spec.name.startswith("step1.")]
    specs = [*case.input_specs(), *outputs]
    # a data-dependent dim (-1: a routed expert's tokens) counts as the case's token count, its upper bound
    need = sum(math.prod(case.tokens if d == -1 else d for d in spec.shape) * _itemsize(resolve_dtype(spec.dtype,
                                                                                                     case.dtype))
               for spec in specs)
    resources.check_memory(need, f"case {case.name!r} at tokens={case.tokens}: its input and output tensors")


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4}.get(dtype, 8)


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    try:
        with safe_open(str(path), framework="numpy") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises several unrelated types for a bad file
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                      "U64": "uint64", "BOOL": "bool"}


def tensor_layouts(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype (numpy's name) and shape, from the file's header alone: checking a runner's outputs
    needs no read of their data."""
    try:
        with safe_open(str(path), framework="numpy") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            return {name: (SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()), list(s.get_shape()))
                    for name, s in slices.items()}
    except Exception as error:  # safetensors raises several unrelated types for a bad file
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None


def tensor_sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def generate(case: Case) -> dict[str, np.ndarray]:
    """Each tensor from its own stream, seeded by (case seed, tensor name): adding a tensor moves no other."""
    tensors = {}
    for spec in case.input_specs():
        if spec.role == "labels":  # the next token of each position; the last predicts nothing (-100)
            ids = tensors[spec.name.removesuffix("labels") + "input_ids"]  # step{k}.mb{m}.labels: that micro-batch's
            tensors[spec.name] = np.concatenate([ids[1:], np.array([-100], dtype=np.int64)])
            continue
        dist = case.tensors[spec.name]
        rng = np.random.default_rng([case.seed, zlib.crc32(spec.name.encode())])
        if dist["dist"] == "randint":
            tensors[spec.name] = rng.integers(0, int(dist["high"]), spec.shape, dtype=np.int64)
            continue
        dtype = format_of(resolve_dtype(spec.dtype, case.dtype)).float_dtype
        if dist["dist"] == "normal":
            values = rng.standard_normal(spec.shape, dtype=np.float32) * dist["std"] + dist["mean"]
        else:
            values = rng.uniform(dist["low"], dist["high"], spec.shape).astype(np.float32)
        tensors[spec.name] = values.astype(dtype)  # round to nearest even, once
    return tensors


def _recipe(case: Case, imported: dict[str, tuple[np.ndarray, dict]]) -> dict:
    return {
        "generator_version": GENERATOR_VERSION,
        "op": case.op,
        "dtype": case.dtype,
        "seed": case.seed,
        "inputs": {s.name: {"shape": list(s.shape), "role": s.role} for s in case.input_specs()},
        "distributions": case.tensors,
        "imported": {name: source for name, (_, source) in imported.items()},
        "perturb": vars(case.perturb) if case.perturb else None,
    }


def _write(case: Case, folder: Path, recipe: dict, digest: str, imported: dict) -> None:
    tensors = generate(case)
    for name, (array, _) in imported.items():
        tensors[name] = array
    manifest = {
        "schema": 1,
        "case": case.name,
        "digest": digest,
        "generator_version": GENERATOR_VERSION,
        "recipe": recipe,
        "tensors": _describe(tensors),
        "perturbed": None,
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=folder.parent))
    try:
        _save(tensors, staging / INPUTS)
        if case.perturb:
            perturbed = _flip_bit(tensors, case.perturb)
            file_name = f"inputs.{case.perturb.side}.safetensors"
            _save(perturbed, staging / file_name)
            manifest["perturbed"] = {**vars(case.perturb), "index": list(case.perturb.index), "file": file_name,
                                     "tensors": _describe(perturbed)}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    except BaseException:  # a full disk or a signal: leave no half-written staging folder behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, folder)  # atomic: a concurrent writer of the same digest wins, we reuse its files
    except OSError:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    """safetensors' writer reports a full disk as its own error type: give it back as the OSError it is."""
    try:
        save_file(tensors, str(path))
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - SafetensorError carries the OS's message only as text
        raise OSError(_errno_in(str(error)), f"{error}", str(path)) from None


def _errno_in(text: str) -> int:
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        if os.strerror(code).lower() in text.lower():
            return code
    return errno.EIO


def _describe(tensors: dict[str, np.ndarray]) -> dict:
    return {name: {"dtype": array.dtype.name, "shape": list(array.shape), "sha256": tensor_sha256(array)}
            for name, array in tensors.items()}


def _flip_bit(tensors: dict[str, np.ndarray], perturb) -> dict[str, np.ndarray]:
    flipped = dict(tensors)
    array = tensors[perturb.tensor].copy()
    bits = array.view(format_of(array.dtype).bits_dtype)
    bits[perturb.index] ^= bits.dtype.type(1 << perturb.bit)
    flipped[perturb.tensor] = array
    return flipped


def _import_weights(case: Case, weights_file: str | None) -> dict[str, tuple[np.ndarray, dict]]:
    """Read the case's weights from a user's safetensors file, by that file's tensor names."""
    spec = case.weights_from
    file = weights_file or spec.file
    if not file:
        raise CheckpointError(f"case {case.name!r} takes its weights from a file: pass --weights FILE "
                              f"(it needs tensors {sorted(n for names in spec.tensors.values() for n in names)})")
    path = _package_file(case, spec.package, file) if spec.package and not weights_file else Path(file).expanduser()
    if not path.is_file():
        raise CheckpointError(f"case {case.name!r}: weights file {path} does not exist")
    shapes = {s.name: s.shape for s in case.input_specs()}
    dtype = format_of(case.dtype).float_dtype
    try:
        return _read_weights(case, spec, path, shapes, dtype)
    except (CheckpointError, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - safetensors raises several unrelated types for a bad file
        raise CheckpointError(f"case {case.name!r}: weights file {path} is not a readable safetensors file: "
                              f"{type(error).__name__}: {error}") from None


def _read_weights(case: Case, spec, path: Path, shapes: dict, dtype) -> dict[str, tuple[np.ndarray, dict]]:
    imported = {}
    with safe_open(str(path), framework="numpy") as handle:
        available = set(handle.keys())
        for canonical, names in spec.tensors.items():
            missing = [n for n in names if n not in available]
            if missing:
                raise CheckpointError(f"{path}: no tensor {missing[0]!r} (needed for {canonical!r} of case "
                                      f"{case.name!r}); the file holds {len(available)} tensors")
            parts = [handle.get_tensor(n) for n in names]
            array = np.concatenate(parts, axis=spec.concat_dim) if len(parts) > 1 else parts[0]
            if tuple(array.shape) != shapes[canonical]:
                raise CheckpointError(f"{path}: tensors {list(names)} give {canonical!r} shape {list(array.shape)}, "
                                      f"case {case.name!r} needs {list(shapes[canonical])}")
            source = {"file": str(path.resolve()), "names": list(names), "concat_dim": spec.concat_dim,
                      "source_dtype": array.dtype.name, "sha256": tensor_sha256(array)}
            imported[canonical] = (np.ascontiguousarray(array.astype(dtype)), source)
    return imported


def _package_file(case: Case, package: str, file: str) -> Path:
    """A file shipped inside an installed package, found without importing it (its __init__ may pull more)."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise CheckpointError(f"case {case.name!r} takes its weights from package {package!r}, which is not "
                              f"installed: pip install --no-deps -r requirements-weights.txt")
    return Path(list(found.submodule_search_locations)[0]) / file


SLICED_BY_EXPERT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
FP8_BLOCK = 128  # DeepSeek-V3 / Kimi-K2 FP8 checkpoints: one weight_scale_inv per 128 x 128 block


def _import_model_weights(case: Case, weights_file: str) -> dict[str, tuple[np.ndarray, dict]]:
    """A model case's weights from a user's HF checkpoint (one safetensors file, or a folder of shards with
    model.safetensors.index.json), by the case's own HF names, sliced to the case's layers and experts: layer N and
    expert E are the checkpoint's layer N and expert E, the router's weight and bias keep their first E rows. FP8
    weights with a ``weight_scale_inv`` (Kimi-K2's release) are dequantized blockwise in float32 first."""
    path = Path(weights_file).expanduser()
    files = _model_files(path)
    imported = {}
    for spec in case.input_specs():
        if spec.role != "weight":
            continue
        if spec.name not in files:
            raise CheckpointError(f"{path}: no tensor {spec.name!r} (case {case.name!r} needs every parameter of its "
                                  f"{case.config['model']['num_hidden_layers']} layers in HF names)")
        array = _read(files[spec.name], spec.name)
        source = {"file": str(files[spec.name].resolve()), "names": [spec.name], "source_dtype": array.dtype.name}
        scale_name = spec.name + "_scale_inv"
        if array.dtype.itemsize == 1 and scale_name in files:
            array = _dequantize_fp8(array, _read(files[scale_name], scale_name))
            source["dequantized_with"] = scale_name
        if array.shape != spec.shape and spec.name.endswith(SLICED_BY_EXPERT) and \
                array.shape[1:] == spec.shape[1:] and array.shape[0] >= spec.shape[0]:
            array = array[:spec.shape[0]]
            source["rows"] = [0, spec.shape[0]]
        if tuple(array.shape) != spec.shape:
            raise CheckpointError(f"{files[spec.name]}: tensor {spec.name!r} has shape {list(array.shape)}, case "
                                  f"{case.name!r} needs {list(spec.shape)} (config.model must match the checkpoint)")
        dtype = format_of(resolve_dtype(spec.dtype, case.dtype)).float_dtype
        converted = np.ascontiguousarray(array.astype(np.float32).astype(dtype) if array.dtype != dtype else array)
        source["sha256"] = tensor_sha256(converted)
        imported[spec.name] = (converted, source)
    return imported


def _model_files(path: Path) -> dict[str, Path]:
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: a folder without model.safetensors.index.json or *.safetensors files")
        return {name: shard for shard in shards for name in resources.safetensors_keys(shard, CheckpointError)}
    if not path.is_file():
        raise CheckpointError(f"weights {path} do not exist")
    return dict.fromkeys(resources.safetensors_keys(path, CheckpointError), path)



def _read(file: Path, name: str) -> np.ndarray:
    with safe_open(str(file), framework="numpy") as handle:
        return handle.get_tensor(name)


def _dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    values = weight.astype(np.float32)
    rows, cols = values.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return values * scale[:rows, :cols]
