"""Per-module md5 dumps as a run (``python -m harness compare-runs DUMPS_A DUMPS_B --hook-dumps``, docs/attach.md):
the first module whose output, input or gradient departs, per step, micro-batch and rank.

The format, read from PaddleFleet's public source (PaddlePaddle/PaddleFleet, ``src/paddlefleet/align_dump_utils.py``
at commit 6b77ba8f1dba51fed5fe040b43fe3290566578e3: ``pf_dump_forward`` and ``pf_dump_grad_hook``), one line per
tensor, ANSI colours stripped, other lines ignored::

    [DUMP PF] forward step{N} {module}/{quantity} md5={H} shape={S}
    [DUMP PF] grad {module}/{quantity} step{N} md5={H} shape={S}

H is the md5 of the tensor cast to float32, its first 16 hex digits (or all 32); S the shape as a Python tuple; N
counts the module's forward calls (forward) or that tensor's gradients (grad) from 1, so with M micro-batches a step,
call N is step (N - 1) // M + 1, micro-batch (N - 1) % M. The bracket's tag (``PF``, ``MG``, ...) is the side's and
not compared. ``harness.attach.dump_hooks`` writes this format from hooks on any torch or Paddle model. The code that
``ENABLE_SAVE_HOOK`` / ``SAVE_TENSOR_NAMES`` drive (their ``logs/pf`` and ``logs/mg`` folders) is not in PaddleFleet's
public source at any commit read here, so its files are read only where they print these lines.

A run is a file, or a folder of files (``workerlog.*``, ``*.log``, ``*.out``, ``*.txt``), one per rank: the rank is
the number of ``workerlog.R`` or of ``rank{R}`` in the name; one file is rank 0. Run B's module names are run A's,
or put in run A's by a name map (a JSON or TOML table of 'module in A' = 'module in B', as ``diff``'s). It fails
closed: a record one run has and the other lacks, a line that does not read whole, a call number skipped or repeated,
a run cut off inside a step, a module the map does not name are ERRORs naming the file, line or module.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from harness.compare.dumps import DumpError, read_name_map
from harness.compare.loss_logs import ANSI, step_summary
from harness.compare.tensors import DIFF, EQUAL, MISSING, SHAPE_MISMATCH, TensorComparison

MARKER = re.compile(r"\[DUMP \w+\]")
HEX = r"(?P<md5>[0-9a-fA-F]{32}|[0-9a-fA-F]{16})(?![0-9A-Za-z_])"
SHAPE = r"shape=(?P<shape>\([0-9, ]*\))"
FORWARD = re.compile(r"\[DUMP (?P<side>\w+)\] forward step(?P<call>\d+) (?P<tag>\S+) md5=" + HEX + r"\s+" + SHAPE)
BACKWARD = re.compile(r"\[DUMP (?P<side>\w+)\] grad (?P<tag>\S+) step(?P<call>\d+) md5=" + HEX + r"\s+" + SHAPE)
FORM = "[DUMP SIDE] forward stepN MODULE/NAME md5=H shape=(..) or [DUMP SIDE] grad MODULE/NAME stepN md5=H shape=(..)"
PHASES = ("forward", "grad")  # within a micro-batch: the forward records, then the backward's
WHAT = "module dumps: md5s of module outputs, inputs and output gradients (PaddleFleet's [DUMP] lines)"
LACKS = "no parameter, parameter gradient or optimizer state was captured"


class HookDumpError(DumpError):
    """A hook dump that cannot be read or paired; the message names the file, line or module, and the value."""


class Record(NamedTuple):
    name: str  # step{k}.{quantity}.rank{r}.mb{m}.{module}: the quantity second, as the report reads it
    key: tuple  # (step, micro-batch, phase, position in the file, rank): time order
    module: str
    quantity: str
    md5: str
    shape: tuple[int, ...]
    where: str  # file:line


class DumpRun(NamedTuple):
    path: Path
    records: dict[str, Record]
    steps: int
    files: list[str]


def dump_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file()
                  and (p.name.startswith("workerlog.") or p.name.endswith((".log", ".out", ".txt"))))


def _rank(file: Path, files: list[Path]) -> int:
    match = re.fullmatch(r"workerlog\.(\d+)", file.name) or re.search(r"rank[_-]?(\d+)", file.name)
    if match:
        return int(match.group(1))
    if len(files) == 1:
        return 0
    raise HookDumpError(f"{file}: which rank wrote it? A folder of several dumps names each file workerlog.R or with "
                        f"rank{{R}} in its name ({len(files)} files: {', '.join(f.name for f in files[:5])})")


def read(path, micro_batches: int = 1, names: dict[str, str] | None = None, map_file: Path | None = None) -> DumpRun:
    """A hook-dump run; `names` maps its module names to the other run's (``map_file`` is where it came from)."""
    path = Path(path)
    if micro_batches < 1:
        raise HookDumpError(f"--micro-batches must be at least 1 (got {micro_batches})")
    if not path.exists():
        raise HookDumpError(f"{path} does not exist")
    files = dump_files(path)
    if not files:
        raise HookDumpError(f"{path}: no dump file (workerlog.*, *.log, *.out, *.txt)")
    records, steps, positions = {}, 0, {}
    for file in files:
        rank, calls = _rank(file, files), {}
        for number, line in enumerate(_lines(file), 1):
            for fields in _parse(ANSI.sub("", line), f"{file}:{number}"):
                where = f"{file}:{number}"
                module, quantity = _split(fields["tag"], where)
                module = _mapped(module, names, map_file, where)
                series = (fields["phase"], module, quantity)
                call = int(fields["call"])
                if call != calls.get(series, 0) + 1:
                    raise HookDumpError(f"{where}: {fields['phase']} {module}/{quantity} is call {call} after call "
                                        f"{calls.get(series, 0)}: a record skipped or repeated")
                calls[series] = call
                position = positions.setdefault(series, len(positions))
                step, mb = (call - 1) // micro_batches + 1, (call - 1) % micro_batches
                steps = max(steps, step)
                name = f"step{step}.{quantity}.rank{rank}.mb{mb}.{module}"
                key = (step, mb, PHASES.index(fields["phase"]), position, rank)
                records[name] = Record(name, key, module, quantity, fields["md5"].lower(), fields["shape"], where)
        for (phase, module, quantity), count in calls.items():
            if count % micro_batches:
                raise HookDumpError(f"{file}: {phase} {module}/{quantity} was dumped {count} times, not a whole "
                                    f"number of steps of {micro_batches} micro-batches: a run cut off inside a step, "
                                    "or --micro-batches other than the run's")
    if not records:
        raise HookDumpError(f"{path}: no [DUMP ...] line in {len(files)} file(s) "
                            f"({', '.join(f.name for f in files[:5])}); expected lines as {FORM}")
    return DumpRun(path, dict(sorted(records.items(), key=lambda item: item[1].key)), steps, [str(f) for f in files])


def _lines(file: Path) -> list[str]:
    try:
        return file.read_text(encoding="utf-8", errors="ignore").splitlines()
    except OSError as error:
        raise HookDumpError(f"{file}: cannot read: {error}") from None


def _parse(line: str, where: str) -> list[dict]:
    """Every record a line prints, each read whole (a marker whose record does not read is an error)."""
    found = []
    for marker in MARKER.finditer(line):
        match = FORWARD.match(line, marker.start()) or BACKWARD.match(line, marker.start())
        if match is None:
            raise HookDumpError(f"{where}: a [DUMP] record that does not read as {FORM} (H: 16 or 32 hex digits): "
                                f"{line.strip()!r}")
        phase = "forward" if match.re is FORWARD else "grad"
        shape = tuple(int(part) for part in match["shape"].strip("()").replace(" ", "").split(",") if part)
        found.append({**match.groupdict(), "phase": phase, "shape": shape})
    return found


def _split(tag: str, where: str) -> tuple[str, str]:
    module, _, quantity = tag.rpartition("/")
    if not module or not quantity:
        raise HookDumpError(f"{where}: {tag!r} is not MODULE/NAME")
    return module, quantity


def _mapped(module: str, names: dict[str, str] | None, map_file: Path | None, where: str) -> str:
    if names is None:
        return module
    if module not in names:
        raise HookDumpError(f"{where}: module {module!r} of run B is in no entry of the name map {map_file} ('module "
                            "in A' = 'module in B'): every dumped module must be mapped, or the runs are not paired")
    return names[module]


def read_pair(a, b, micro_batches: int = 1, name_map: Path | None = None) -> tuple[DumpRun, DumpRun]:
    """Both runs, run B's module names put in run A's through `name_map` (``harness.compare.dumps``' name map: a
    JSON or TOML table of 'module in A' = 'module in B')."""
    names = None
    if name_map:
        names = {}
        for mine, theirs in read_name_map(name_map).items():
            if theirs in names:
                raise HookDumpError(f"{name_map}: run B's module {theirs!r} is named for both {names[theirs]!r} and "
                                    f"{mine!r} of run A")
            names[theirs] = mine
    return read(a, micro_batches), read(b, micro_batches, names, name_map)


def compare(a: DumpRun, b: DumpRun) -> tuple[list[TensorComparison], dict]:
    """(one comparison per record, in time order; the training level's summary along time)."""
    names = sorted({*a.records, *b.records}, key=lambda n: (a.records.get(n) or b.records[n]).key)
    rows = [_compare(name, a.records.get(name), b.records.get(name)) for name in names]
    records = {**b.records, **a.records}
    steps = [step_summary(step, [row for row in rows if row.name.startswith(f"step{step}.")])
             for step in range(1, max(a.steps, b.steps) + 1)]
    first = next((row for row in rows if row.status != EQUAL), None)
    divergence = None
    if first is not None:
        held = records[first.name]
        step, mb, _, _, rank = held.key
        divergence = {"step": step, "quantity": held.quantity, "tensor": first.name, "module": held.module,
                      "micro_batch": mb, "rank": rank}
    quantities = [q for s in steps for q in s["quantities"]]
    return rows, {"steps": steps, "parameters": 0, "steps_kept": [], "truth": {},
                  "order": list(dict.fromkeys(quantities)), "first_divergence": divergence,
                  "loss_only": {"kind": "hook dumps", "what": WHAT, "a": {"files": a.files},
                                "b": {"files": b.files}, "lacks": LACKS}}


def _compare(name: str, a: Record | None, b: Record | None) -> TensorComparison:
    if a is None or b is None:
        held, label, other = (a, "A", "B") if a else (b, "B", "A")
        return TensorComparison(name, MISSING, note=f"only run {label} dumps it ({held.where}); run {other} does "
                                                    "not: it ended earlier, or dumps other modules")
    where = f"A {a.where}, B {b.where}"
    if a.shape != b.shape:
        return TensorComparison(name, SHAPE_MISMATCH, note=f"shape {list(a.shape)} vs {list(b.shape)} ({where})")
    if len(a.md5) != len(b.md5):
        return TensorComparison(name, MISSING, note=f"md5s of {len(a.md5)} and {len(b.md5)} hex digits ({where}): "
                                                    "dumps of two formats")
    return TensorComparison(name, EQUAL if a.md5 == b.md5 else DIFF, shape=list(a.shape),
                            note=f"compared by md5 ({a.md5} vs {b.md5}; {where})")

