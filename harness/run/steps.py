"""Per-step dumps of a training run (op ``causal_lm_train``, docs/training.md), framework-free: one safetensors file per
step, written as the step ends, so a run of 100 steps never holds more than one step's state in memory.

``steps/step00007.safetensors`` holds step 7's tensors in canonical names (``step7.lr``, ``step7.loss``,
``step7.grad.<p>``, ...). For a step the request does not keep (``train.steps_kept``) it holds the scalars only and,
in the file's metadata, one digest per state tensor of its raw bytes in canonical layout and dtype, named by its
algorithm: the comparator still says per step and tensor whether the bits are equal, without the disk a full dump
needs. Where the tensors are decides the algorithm: a run on the CPU hashes them where they are, on the host, with
XXH3-128 (``xxh3_128:<hex>``); a run on a GPU digests them on the GPU with ``bits128v1`` (``harness.run.bits128``, the
runner's ``digests``), so only 16 bytes per tensor come to the host. Both sides of a comparison run on one device, so
they use one algorithm; the comparator recomputes a kept tensor's digest in the other side's algorithm and refuses
two digests of different algorithms (never equal, never called a difference either).

A digest-only step also records each digested tensor's dtype and shape (``layouts``), checked as a kept tensor's are.
A kept step's file gives its all-zero blocks back to the disk once written (``harness.run.sparse_files``: the same
bytes to every reader; a MoE step is about a third zeros, the experts no token reached).

A step file appears whole: it is written under a temporary name and renamed once complete (its zero blocks punched
out), so a reader that finds ``step00007.safetensors`` finds all of it. A night follows its training runs as they write
(``harness.compare.train_follow``): it judges each step as soon as every run has written it and gives back the tensors
no later judgment reads (``give_back``: the file keeps its scalars and becomes one digest per tensor, ``given_back`` in
its metadata). A run the night follows is paced (``PACE`` in its request's config): it writes step k only once the
harness has consumed step k - 1 of its folder (``step00006.consumed``) or released it (``RELEASED``: a run it followed
ended early), so no run is more than a step ahead of the others and a folder holds about two steps' tensors at once.

On several ranks (data or expert parallel, docs/training-ranks.md) rank 0 writes the step file, the canonical state
whole; every other rank writes ``step00007.rank<R>.safetensors`` with its scalars, one digest per tensor it holds whole
(its own replica) and, of each tensor the ranks hold in pieces (a distributed optimizer's ranges, an expert-parallel
rank's experts), one digest per piece it holds, made before any gather, with the piece's place (``pieces``: elements
[start, end) of the flattened canonical tensor). On a digest-only step rank 0 writes the digests of those places of
its canonical tensors. The harness checks every rank against rank 0 (``ranks_agree``): a replica that departs, or a
piece that is not where rank 0's tensor has it, is found.

A training run's outputs contract, beside ``harness.run.protocol``: runners write with ``StepWriter`` (their framework
gives ``save`` and ``raw_bytes``); the harness validates (``validate``, ``ranks_agree``) and the comparator reads
(``read_header``).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from harness.case.train_settings import Flip
from harness.families import model_config
from harness.run import bits128, sparse_files

STEPS_DIR = "steps"
# A run no request started (a recorder in the user's own loop: harness.attach) describes itself in meta.json under this
# key, in a request's fields (dtype, tokens, device, config: {model, train}); compare-runs reads it.
CAPTURE = "capture"
STATE_ABOUT = "state.json"  # a state folder's record of whose state it holds, after which step, for which run


PACE = "train_pace"  # a request's config key: the harness follows this run's steps and paces it (module docstring)
RELEASED = "RELEASED"  # in a paced run's steps folder: write on, the harness follows no more
ENDED = "ENDED"  # in a followed run's steps folder: the harness saw the runner end
PACE_POLL_SECONDS = 0.05


def step_file(folder, step: int, rank: int = 0) -> Path:
    """Rank 0's (the canonical) step file, or another rank's."""
    return Path(folder) / STEPS_DIR / (f"step{step:05d}.safetensors" if rank == 0 else
                                       f"step{step:05d}.rank{rank}.safetensors")


DIGEST = "xxh3_128"  # the host's: ~8-25 GB/s a core here, BLAKE2b (before) ~0.9, bits128v1 in numpy ~0.5
DIGESTS = (DIGEST, bits128.ALGORITHM)  # every algorithm a step file's digest may be made with


def digest(raw) -> str:
    """The digest of a tensor's raw bytes (anything the buffer protocol reads: bytes, a numpy uint8 view), named by its
    algorithm, so a digest made another way never equals it."""
    import xxhash  # here, not at the top: a run without training steps does not need the package

    return f"{DIGEST}:{xxhash.xxh3_128(raw).hexdigest()}"


def algorithm_of(value: str) -> str:
    """The algorithm a digest names (``xxh3_128:...`` -> ``xxh3_128``)."""
    return value.split(":", 1)[0]


def digest_as(algorithm: str, array: np.ndarray) -> str:
    """A host array's digest in `algorithm` (one of DIGESTS): what a kept tensor is checked against another side's or
    rank's digest with."""
    if algorithm == DIGEST:
        return digest(np.ascontiguousarray(array).view(np.uint8))
    if algorithm == bits128.ALGORITHM:
        return bits128.digest_numpy(array)
    raise ValueError(f"no digest algorithm {algorithm!r} (known: {', '.join(DIGESTS)})")


DOUBLES = "doubles"  # the step file's metadata entry of StepWriter.write's `doubles`
DIGEST_THREADS = 4
DIGEST_BATCH_BYTES = 8 << 20  # a thread hashes tensors in batches of about this many bytes (one task per small tensor
# cost more in the pool's hand-offs than the hashing: a 384-expert step holds ~3,200 small tensors)


class StepWriter:
    """Writes each step's file. `save(tensors, path, metadata)` is the framework's safetensors writer, `raw_bytes(t)`
    the tensor's bytes in canonical layout (contiguous), hashed on the host (XXH3); `digests(tensors)`, where given,
    the digests of a list of tensors made where they are (a GPU run's: bits128v1 on the GPU) instead; `kept` the steps
    whose state tensors are written whole; a `rank` other than 0 writes digests only, into its own file."""

    def __init__(self, folder, kept, save, raw_bytes, rank: int = 0, digests=None):
        self.folder, self.save, self.raw_bytes, self.rank = Path(folder), save, raw_bytes, rank
        self.digests = digests
        self.kept = set(kept) if rank == 0 else set()
        self.paced = rank == 0 and paced(self.folder)
        (self.folder / STEPS_DIR).mkdir(parents=True, exist_ok=True)

    def write(self, step: int, scalars: dict, states: dict, pieces: dict | None = None,
              doubles: dict | None = None) -> None:
        """`scalars` and `states` keyed by canonical names without the ``step{k}.`` prefix; `pieces` {name: [(start,
        end, flat values)]}: elements [start, end) of canonical tensor `name` as this rank holds them (rank 0: the
        places other ranks hold, from its own canonical tensor), digested unless the step is kept; `doubles`: a
        scalar the stack holds as a Python float beside the value it applies (Megatron's norm and clip factor),
        shown, never compared (``DOUBLES`` in the metadata)."""
        prefix = f"step{step}."
        if step in self.kept:
            tensors, metadata = {**scalars, **states}, {"kept": "true"}
        else:
            spans = [(name, None, t) for name, t in states.items()]
            spans += [(name, (start, end), t) for name, held in (pieces or {}).items() for start, end, t in held]
            digests = self._digests([t for _, _, t in spans])
            whole, layouts, placed = {}, {}, {}
            for (name, span, tensor), value in zip(spans, digests, strict=True):
                if span is None:
                    whole[prefix + name], layouts[prefix + name] = value, layout(tensor)
                else:
                    placed.setdefault(prefix + name, []).append([*span, layout(tensor)[0], value])
            tensors, metadata = scalars, {"kept": "false", "digests": json.dumps(whole),
                                          "layouts": json.dumps(layouts), "pieces": json.dumps(placed)}
        if doubles:
            metadata[DOUBLES] = json.dumps({prefix + name: float(value) for name, value in doubles.items()})
        if self.paced and step > 1:
            wait_consumed(self.folder, step - 1)
        path = step_file(self.folder, step, self.rank)
        partial = partial_of(path)
        try:
            self.save({prefix + name: tensor for name, tensor in tensors.items()}, str(partial), metadata)
            if step in self.kept:  # its zero blocks (experts no token reached) back to the disk, its bytes unchanged
                sparse_files.punch_zeros(str(partial))
            os.replace(partial, path)  # whole, at once: a reader following the run never sees part of it
        except BaseException:
            partial.unlink(missing_ok=True)  # no part of a step left behind (a full disk, an interrupted save)
            raise

    def _digests(self, tensors: list) -> list[str]:
        if self.digests is not None:  # where the tensors are: 16 bytes each come to the host
            return list(self.digests(tensors))
        # on the host, a few tensors at a time: the host copy and the hash both release the GIL (a full-size step is
        # 79 GB per side: one thread hashed it with BLAKE2b in about 80 s on the H200's host); memory stays at a few
        # tensors
        with ThreadPoolExecutor(max_workers=DIGEST_THREADS) as pool:
            hashed = pool.map(lambda batch: [digest(self.raw_bytes(t)) for t in batch], _batches(tensors))
            return [d for batch in hashed for d in batch]


PARTIAL_SUFFIX = ".partial.safetensors"


def partial_of(path: Path) -> Path:
    """Where a step file is written before it is whole (``step00007.partial.safetensors``: a night's clean-up of
    tensor files finds one a killed runner left)."""
    return path.with_suffix(PARTIAL_SUFFIX)


def paced(folder: Path) -> bool:
    """Whether the request in `folder` (the harness's runner folder) asks for pacing; a run no request started (a
    recorder in the user's own loop) is not paced."""
    try:
        request = json.loads((folder / "request.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool((request.get("config") or {}).get(PACE))


def consumed_marker(folder, step: int) -> Path:
    return Path(folder) / STEPS_DIR / f"step{step:05d}.consumed"


def wait_consumed(folder, step: int) -> None:
    """Until the harness has consumed step `step` of this run's folder, or released it, or is gone (this process was
    handed to another parent: nobody will consume it, and a runner left waiting would never end)."""
    steps_dir, parent = Path(folder) / STEPS_DIR, os.getppid()
    while not (consumed_marker(folder, step).exists() or (steps_dir / RELEASED).exists()) and os.getppid() == parent:
        time.sleep(PACE_POLL_SECONDS)


def handed_marker(folder, step: int, mode: str) -> Path:
    """In side a's steps folder: the harness hands side a's step `step` to the re-fed run in `mode` beside it."""
    return Path(folder) / STEPS_DIR / f"step{step:05d}.handed-{mode}"


def fed_marker(folder, step: int, mode: str) -> Path:
    """In side a's steps folder, from a re-fed run beside it: the run in `mode` has read all it takes of side a's step
    `step` (its state, for the next step), so the harness may give that step's tensors back."""
    return Path(folder) / STEPS_DIR / f"step{step:05d}.fed-{mode}"


def await_handed(folder, step: int, mode: str) -> None:
    """A re-fed run beside side a (it is paced: ``harness.compare.train_refeed.Beside``), before it reads side a's step
    `step` (side a's folder: `folder`): until the harness hands the step over, or follows no more (``RELEASED``), or
    side a ended without it, or the harness is gone (the read that follows then says what is missing)."""
    steps_dir, parent = Path(folder) / STEPS_DIR, os.getppid()
    while not (handed_marker(folder, step, mode).exists() or (steps_dir / RELEASED).exists()
               or ((steps_dir / ENDED).exists() and not step_file(folder, step).exists())) and os.getppid() == parent:
        time.sleep(PACE_POLL_SECONDS)


def mark(folder, name: str) -> None:
    """An empty marker file in the run's steps folder (``RELEASED``, ``ENDED``, a step's ``.consumed``)."""
    steps_dir = Path(folder) / STEPS_DIR
    steps_dir.mkdir(parents=True, exist_ok=True)
    (steps_dir / name).touch()


def give_back(path) -> int:
    """A kept step file made digest-only once nothing reads its tensors any more (a night's, module docstring): its
    scalars stay tensors, every other tensor becomes its digest and layout, as a step the request does not keep holds
    them, with ``given_back`` in the metadata; the bytes of disk it gave back."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path = Path(path)
    before = path.stat().st_blocks * 512
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("kept") != "true":
            return 0
        scalars, whole, layouts = {}, {}, {}
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if name.count(".") == 1:  # step7.lr: a scalar
                scalars[name] = tensor
            else:
                whole[name], layouts[name] = digest_as(DIGEST, tensor), layout(tensor)
    metadata = {**metadata, "kept": "false", "given_back": "true", "digests": json.dumps(whole),
                "layouts": json.dumps(layouts), "pieces": "{}"}
    partial = str(partial_of(path))
    save_file(scalars, partial, metadata)
    os.replace(partial, path)
    return before - path.stat().st_blocks * 512


def layout(tensor) -> list:
    """[dtype, shape] of a torch tensor or numpy array, in numpy's dtype names (torch's without their ``torch.``
    prefix: the same names for every dtype a step holds), as ``read_header`` gives a kept tensor's."""
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]


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


class StepHeader(NamedTuple):
    """A step file's header: whether its state tensors are kept; {tensor: (dtype, shape)} of the tensors it holds;
    {tensor: digest} and {tensor: [dtype, shape]} of those it holds as digests only; {tensor: [[start, end, dtype,
    digest]]} of the pieces it holds digests of; whether the harness gave its tensors back (``give_back``)."""

    kept: bool
    layouts: dict
    digests: dict
    digest_layouts: dict
    pieces: dict
    given_back: bool = False


def read_header(path) -> StepHeader:
    """The step file's header alone (no tensor data read)."""
    from safetensors import safe_open

    from harness.case.checkpoints import SAFETENSORS_DTYPES

    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        layouts = {}
        for name in handle.keys():
            piece = handle.get_slice(name)
            layouts[name] = (SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()), list(piece.get_shape()))
    return StepHeader(metadata.get("kept") == "true", layouts, *(json.loads(metadata.get(key, "{}"))
                                                                 for key in ("digests", "layouts", "pieces")),
                      metadata.get("given_back") == "true")


def state_locations(family: str, framework: str, optimizer, quantities) -> dict[str, str]:
    """Where the framework keeps each quantity the runner writes: [<fw>.train] of the family's name map, and the
    optimizer's state from its record (harness.optimizers). Together they must name exactly `quantities`."""
    import tomllib

    from harness.families import family_of

    table = tomllib.loads(family_of(family).names.read_text())[framework].get("train", {})
    located = {**table, **optimizer.locations[framework]}
    if set(located) != set(quantities) or set(table) & set(optimizer.state):
        raise ValueError(f"[{framework}.train] of the {family} name map names {sorted(table)}, the {optimizer.name} "
                         f"record {sorted(optimizer.locations[framework])}; the runner writes {sorted(quantities)}")
    return {quantity: located[quantity] for quantity in quantities}


def flip_bit(array: np.ndarray, index, bit: int) -> np.ndarray:
    """A copy of `array` with one bit of one element flipped (the negative control's planted difference)."""
    from harness.bits import format_of

    flipped = array.copy()
    bits = flipped.view(format_of(array.dtype).bits_dtype)
    bits[tuple(index)] ^= bits.dtype.type(1 << bit)
    return flipped


def flips_here(flip: Flip | None, step: int, rank: int) -> bool:
    """Whether this rank plants the negative control's bit after `step`: every rank does (each flips its own copy or
    piece, so the ranks stay consistent) unless ``flip.rank`` names one, which alone flips its own (its ranks then
    disagree: the planted departure)."""
    return bool(flip) and flip.after_step == step and flip.rank in (None, rank)


def validate(folder, case) -> str:
    """What is wrong with a training side's step files for `case` (its request's steps_kept), or "": every step's file,
    every kept tensor, and every other state tensor's digest, in its dtype and shape."""
    from harness.case.ops import train_step_outputs
    from harness.case.specs import resolve_dtype

    train, m = case.train, case.model
    for step in range(1, train.steps + 1):
        path = step_file(folder, step)
        if not path.exists():
            return f"{path} is missing"
        try:
            header = read_header(path)
        except Exception as error:  # safetensors raises several unrelated types for a bad file
            return f"{path}: not a readable step file: {error}"
        if header.kept != (step in train.steps_kept) and not header.given_back:
            return f"{path}: kept is {header.kept}, the request keeps steps {list(train.steps_kept)}"
        for spec in train_step_outputs(m, train, step):
            scalar = spec.name.count(".") == 1
            if header.kept or scalar:
                if spec.name not in header.layouts:
                    if spec.optional:  # a scalar the stack does not compute (a norm without clipping)
                        continue
                    return f"{path} lacks tensor {spec.name!r} (has {len(header.layouts)} tensors)"
                dtype, shape = header.layouts[spec.name]
            else:
                value = header.digests.get(spec.name)
                if value is None:
                    return f"{path} has no digest of {spec.name!r}"
                if ":" not in value or algorithm_of(value) not in DIGESTS:
                    return (f"{path}: the digest of {spec.name!r} is not {' or '.join(DIGESTS)} ({value[:24]!r}): "
                            "written by another version of the harness")
                if spec.name not in header.digest_layouts:
                    return f"{path} has no layout (dtype, shape) of the digested {spec.name!r}"
                dtype, shape = header.digest_layouts[spec.name]
            if dtype != resolve_dtype(spec.dtype, case.dtype) or tuple(shape) != tuple(spec.shape):
                return (f"{path}: tensor {spec.name!r} is {dtype}{list(shape)}, expected "
                        f"{resolve_dtype(spec.dtype, case.dtype)}{list(spec.shape)}")
    return ""


def ranks_agree(folder, case, ranks: int) -> dict:
    """Whether every rank of a training side ended every step with rank 0's state: per step, each other rank's scalars
    and the digests of its replicas against rank 0's tensors (dtype, shape and bits), and each piece it holds against
    the same place of rank 0's tensor. {"ranks", "checked", "differing" (the first 20, rank named),
    "differing_count", "departures" ({rank: {"step", "tensors", "first"}}: its first step that differs, how many
    there, the first)}, or {"problem": why} when a file is missing, unreadable or lacks what the check needs."""
    checked, differing, departures = 0, [], {}
    for step in range(1, case.train.steps + 1):
        try:
            reference = _rank0_reference(step_file(folder, step))
            for rank in range(1, ranks):
                other = step_file(folder, step, rank)
                if not other.exists():
                    return {"problem": f"{other} is missing"}
                departed = []
                for name, where, theirs in _rank_entries(other):
                    expected = reference(name, where, algorithm_of(theirs[-1]))
                    if expected is None:
                        return {"problem": f"{step_file(folder, step)} has nothing to check {other}'s {name}"
                                           + (f" elements {where[0]}:{where[1]}" if where else "") + " against"}
                    if algorithm_of(expected[-1]) != algorithm_of(theirs[-1]):
                        return {"problem": f"{other} digests {name} with {algorithm_of(theirs[-1])}, "
                                           f"{step_file(folder, step)} with {algorithm_of(expected[-1])}: digests of "
                                           "two algorithms cannot be compared (the ranks ran on different devices?)"}
                    checked += 1
                    if theirs != expected:
                        departed.append(name + (f"[{where[0]}:{where[1]}]" if where else ""))
                differing += [f"{name} (rank {rank})" for name in departed]
                if departed and str(rank) not in departures:
                    departures[str(rank)] = {"step": step, "tensors": len(departed), "first": departed[0]}
        except _BadStepFile as error:
            return {"problem": str(error)}
    return {"ranks": ranks, "checked": checked, "differing": differing[:20], "differing_count": len(differing),
            "departures": departures}


class _BadStepFile(Exception):
    """A step file the rank check cannot read; the message names it."""


def _header(path) -> StepHeader:
    try:
        return read_header(path)
    except Exception as error:  # safetensors raises several unrelated types for a bad file
        raise _BadStepFile(f"{path}: not a readable step file: {error}") from None


def _tensor_digest(array: np.ndarray, algorithm: str = DIGEST) -> str:
    return digest_as(algorithm, array)


def _rank0_reference(path):
    """A function (name, place or None, algorithm) -> what rank 0's step file says of that tensor or place: (dtype,
    shape, digest) of a whole tensor, (dtype, digest) of a place [start, end), a tensor it holds digested in
    `algorithm` (the other rank's); None when it says nothing of it."""
    from safetensors import safe_open

    header = _header(path)
    with safe_open(str(path), framework="numpy") as handle:
        held = {name: handle.get_tensor(name) for name in header.layouts}
    pieces = {name: {(start, end): (dtype, value) for start, end, dtype, value in entries}
              for name, entries in header.pieces.items()}

    def reference(name, where, algorithm=DIGEST):
        if name in held:
            array = held[name]
            if where is None:
                return array.dtype.name, list(array.shape), _tensor_digest(array, algorithm)
            start, end = where
            if not 0 <= start <= end <= array.size:
                raise _BadStepFile(f"{path.parent}: a rank holds elements {start}:{end} of {name}, which has "
                                   f"{array.size}")
            return array.dtype.name, _tensor_digest(array.reshape(-1)[start:end], algorithm)
        if where is None:
            return (*header.digest_layouts[name], header.digests[name]) if name in header.digests else None
        return pieces.get(name, {}).get(tuple(where))

    return reference


def _rank_entries(path):
    """(name, place or None, what this rank holds there) of every scalar, replica and piece in another rank's step
    file, in the form ``_rank0_reference`` answers."""
    from safetensors import safe_open

    header = _header(path)
    with safe_open(str(path), framework="numpy") as handle:
        for name in header.layouts:
            array = handle.get_tensor(name)
            yield name, None, (array.dtype.name, list(array.shape), _tensor_digest(array))
    for name, value in header.digests.items():
        if name not in header.digest_layouts:
            raise _BadStepFile(f"{path} has no layout (dtype, shape) of the digested {name!r}")
        yield name, None, (*header.digest_layouts[name], value)
    for name, entries in header.pieces.items():
        for start, end, dtype, value in entries:
            yield name, (start, end), (dtype, value)


def state_about(folder, model: dict, optimizer: str, dtype: str, master_weights: bool) -> dict:
    """state.json of a state folder (``python -m harness state-for``), checked against the loop that loads it (its
    model config, optimizer record, dtype and masters); ValueError naming the file, the field and both values."""
    path = Path(folder) / STATE_ABOUT
    try:
        said = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: not a state folder (python -m harness state-for writes one)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON: {error}") from None
    mine = {"model": model_config(model).to_dict(), "optimizer": optimizer, "dtype": dtype,
            "master_weights": master_weights}
    for field, value in mine.items():
        if said.get(field) != value:
            raise ValueError(f"{path}: field {field} is {said.get(field)!r}, the loop loading it has {value!r}")
    return said
