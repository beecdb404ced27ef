"""Per-step dumps of a training run (op ``causal_lm_train``, docs/training.md), framework-free: one safetensors file per
step, written as the step ends, so a run of 100 steps never holds more than one step's state in memory.

``steps/step00007.safetensors`` holds step 7's tensors in canonical names (``step7.lr``, ``step7.loss``,
``step7.grad.<p>``, ...). For a step the request does not keep (``train.steps_kept``) it holds the scalars only and,
in the file's metadata, one digest per state tensor (XXH3-128 of its raw bytes in canonical layout and dtype, named:
``xxh3_128:<hex>``): the comparator still says per step and tensor whether the bits are equal, without the disk a full
dump needs.

On several ranks (data or expert parallel, docs/training-ranks.md) every rank gathers the canonical state (a
distributed optimizer's shards, another rank's experts) and rank 0 writes the step file; every other rank writes
``step00007.rank<R>.safetensors`` with its scalars and one digest per state tensor, so the harness checks that every
rank holds the same state (``ranks_agree``), as it checks replicated TP tensors.

A training run's outputs contract, beside ``harness.run.protocol``: runners write with ``StepWriter`` (their framework
gives ``save`` and ``raw_bytes``); the harness validates (``validate``, ``ranks_agree``) and the comparator reads
(``read_header``).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

STEPS_DIR = "steps"


def step_file(folder, step: int, rank: int = 0) -> Path:
    """Rank 0's (the canonical) step file, or another rank's."""
    return Path(folder) / STEPS_DIR / (f"step{step:05d}.safetensors" if rank == 0 else
                                       f"step{step:05d}.rank{rank}.safetensors")


DIGEST = "xxh3_128"  # ~8 GB/s a core here, BLAKE2b (before) ~0.9: a 384-expert step's 180 MB cost 0.2 CPU s per side


def digest(raw) -> str:
    """The digest of a tensor's raw bytes (anything the buffer protocol reads: bytes, a numpy uint8 view), named by its
    algorithm, so a digest made another way never equals it."""
    import xxhash  # here, not at the top: a run without training steps does not need the package

    return f"{DIGEST}:{xxhash.xxh3_128(raw).hexdigest()}"


DOUBLES = "doubles"  # the step file's metadata entry of StepWriter.write's `doubles`
DIGEST_THREADS = 4
DIGEST_BATCH_BYTES = 8 << 20  # a thread hashes tensors in batches of about this many bytes (one task per small tensor
# cost more in the pool's hand-offs than the hashing: a 384-expert step holds ~3,200 small tensors)


class StepWriter:
    """Writes each step's file. `save(tensors, path, metadata)` is the framework's safetensors writer, `raw_bytes(t)`
    the tensor's bytes in canonical layout (contiguous); `kept` the steps whose state tensors are written whole; a
    `rank` other than 0 writes digests only, into its own file."""

    def __init__(self, folder, kept, save, raw_bytes, rank: int = 0):
        self.folder, self.save, self.raw_bytes, self.rank = Path(folder), save, raw_bytes, rank
        self.kept = set(kept) if rank == 0 else set()
        (self.folder / STEPS_DIR).mkdir(parents=True, exist_ok=True)

    def write(self, step: int, scalars: dict, states: dict, doubles: dict | None = None) -> None:
        """`scalars` and `states` keyed by canonical names without the ``step{k}.`` prefix; `doubles`: a scalar the
        stack holds as a Python float beside the value it applies (Megatron's norm and clip factor), shown, never
        compared (``DOUBLES`` in the metadata)."""
        prefix = f"step{step}."
        if step in self.kept:
            tensors, metadata = {**scalars, **states}, {"kept": "true"}
        else:
            # a few tensors at a time: the host copy and the hash both release the GIL (a full-size step is 79 GB per
            # side: one thread hashed it with BLAKE2b in about 80 s on the H200's host); memory stays at a few tensors
            with ThreadPoolExecutor(max_workers=DIGEST_THREADS) as pool:
                hashed = pool.map(lambda batch: [digest(self.raw_bytes(t)) for t in batch], _batches(states.values()))
                digests = {prefix + name: value for name, value in
                           zip(states, (d for batch in hashed for d in batch), strict=True)}
            tensors, metadata = scalars, {"kept": "false", "digests": json.dumps(digests)}
        if doubles:
            metadata[DOUBLES] = json.dumps({prefix + name: float(value) for name, value in doubles.items()})
        self.save({prefix + name: tensor for name, tensor in tensors.items()},
                  str(step_file(self.folder, step, self.rank)), metadata)


def _batches(tensors):
    """Consecutive runs of tensors, in order, each ended by the tensor that brings it to DIGEST_BATCH_BYTES."""
    batch, size = [], 0
    for tensor in tensors:
        batch.append(tensor)
        size += tensor.nbytes
        if size >= DIGEST_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def read_header(path) -> tuple[bool, dict[str, tuple[str, list[int]]], dict[str, str]]:
    """(whether the step's state tensors are kept, {tensor: (dtype, shape)} of what the file holds, {tensor: digest} of
    the state tensors it holds as digests only); from the header alone."""
    from safetensors import safe_open

    from harness.case.checkpoints import SAFETENSORS_DTYPES

    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        layouts = {}
        for name in handle.keys():
            piece = handle.get_slice(name)
            layouts[name] = (SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()), list(piece.get_shape()))
    return metadata.get("kept") == "true", layouts, json.loads(metadata.get("digests", "{}"))


def state_locations(family: str, framework: str, quantities) -> dict[str, str]:
    """[<fw>.train] of the family's name map: where the framework keeps each quantity. It must name exactly the
    quantities the runner writes."""
    import tomllib

    from harness.case.models import FOLDER

    table = tomllib.loads((FOLDER / f"{family}.toml").read_text())[framework].get("train", {})
    if set(table) != set(quantities):
        raise ValueError(f"[{framework}.train] of the {family} name map names {sorted(table)}; the runner writes "
                         f"{sorted(quantities)}")
    return dict(table)


def flip_bit(array: np.ndarray, index, bit: int) -> np.ndarray:
    """A copy of `array` with one bit of one element flipped (the negative control's planted difference)."""
    from harness.bits import format_of

    flipped = array.copy()
    bits = flipped.view(format_of(array.dtype).bits_dtype)
    bits[tuple(index)] ^= bits.dtype.type(1 << bit)
    return flipped


def validate(folder, case) -> str:
    """What is wrong with a training side's step files for `case` (its request's steps_kept), or "": every step's file,
    every kept tensor in its dtype and shape, every other state tensor's digest."""
    from harness.case.ops import resolve_dtype, train_step_outputs

    train, m = case.config["train"], case.config["model"]
    for step in range(1, train["steps"] + 1):
        path = step_file(folder, step)
        if not path.exists():
            return f"{path} is missing"
        try:
            kept, layouts, digests = read_header(path)
        except Exception as error:  # safetensors raises several unrelated types for a bad file
            return f"{path}: not a readable step file: {error}"
        if kept != (step in train["steps_kept"]):
            return f"{path}: kept is {kept}, the request keeps steps {train['steps_kept']}"
        for spec in train_step_outputs(m, train, step):
            scalar = spec.name.count(".") == 1
            if not (kept or scalar):
                if spec.name not in digests:
                    return f"{path} has no digest of {spec.name!r}"
                if not digests[spec.name].startswith(f"{DIGEST}:"):
                    return (f"{path}: the digest of {spec.name!r} is not {DIGEST} ({digests[spec.name][:24]!r}): "
                            "written by another version of the harness")
                continue
            if spec.name not in layouts:
                if spec.optional:  # a scalar the stack does not compute (a norm without clipping)
                    continue
                return f"{path} lacks tensor {spec.name!r} (has {len(layouts)} tensors)"
            dtype, shape = layouts[spec.name]
            if dtype != resolve_dtype(spec.dtype, case.dtype) or tuple(shape) != tuple(spec.shape):
                return (f"{path}: tensor {spec.name!r} is {dtype}{shape}, expected "
                        f"{resolve_dtype(spec.dtype, case.dtype)}{list(spec.shape)}")
    return ""


def ranks_agree(folder, case, ranks: int) -> dict:
    """Whether every rank of a training side ended every step with rank 0's state: per step, each other rank's scalars
    and state digests against rank 0's. {"ranks", "checked", "differing" (the first 20 names, rank named),
    "differing_count"} or {"problem": why} when a rank's file is missing or unreadable."""
    from safetensors import safe_open

    train = case.config["train"]
    checked, differing = 0, []
    for step in range(1, train["steps"] + 1):
        path = step_file(folder, step)
        kept, layouts, digests = read_header(path)
        with safe_open(str(path), framework="numpy") as handle:
            reference = {name: digests.get(name) or digest(np.ascontiguousarray(handle.get_tensor(name))
                                                              .view(np.uint8))
                         for name in (*layouts, *digests)}
        for rank in range(1, ranks):
            other = step_file(folder, step, rank)
            if not other.exists():
                return {"problem": f"{other} is missing"}
            try:
                _, other_layouts, other_digests = read_header(other)
                with safe_open(str(other), framework="numpy") as handle:
                    theirs = {**other_digests, **{name: digest(np.ascontiguousarray(handle.get_tensor(name))
                                                               .view(np.uint8)) for name in other_layouts}}
            except Exception as error:  # safetensors raises several unrelated types for a bad file
                return {"problem": f"{other}: not a readable step file: {error}"}
            for name, expected in reference.items():
                checked += 1
                if theirs.get(name) != expected:
                    differing.append(f"{name} (rank {rank})")
    return {"ranks": ranks, "checked": checked, "differing": differing[:20], "differing_count": len(differing)}
