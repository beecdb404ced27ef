"""Loss-only runs: the artifacts PaddleFleet's alignment gate reads, compared bit for bit along time
(``python -m harness compare-runs LOGS_A LOGS_B``, docs/attach.md: in a CI in place of ``compare_loss.py``).

Read from PaddleFleet's public source (github.com/PaddlePaddle/PaddleFleet):

- logs (``scripts/alignment_model_accuracy/compare_loss.py`` at commit e8c36faf42ccc5719405d8b1884f44a4b7d79581, and
  ``DSV4_8_Cards/compare_loss.py`` at 46d04d6e63be26679735f9c926281537e44869f0 for several losses per micro-batch):
  files named ``workerlog.*``, ``*.log`` or ``*.out``, ANSI colours stripped, several prints per line allowed; per rank,
  in the order printed, one ``per_token_loss: rank=R shape=[1, 50] md5=H`` (the unmasked per-token cross entropy,
  the md5 of its float32 bytes) and one ``final_loss: rank=R val=V md5=H`` (the masked, token-normalised scalar of
  that rank and micro-batch, not reduced across data-parallel ranks: ``val`` printed with ``%.20f``, the md5 of its
  float32 bytes) per micro-batch and loss; record i of a rank is step i // (micro-batches x losses) + 1, micro-batch
  and loss in that order within the step (``-m``; ``--pf-loss-order`` / ``--mg-loss-order``: ``main,mtp`` on one
  side, ``mtp,main`` on the other). ``[LOSS_PATH_MD5] rank=R NAME shape=[..] md5=H`` lines (PaddleFleet's loss-path
  probes, ``LOG_LOSS_MD5=1``: logits, labels, the final norm's output, ...) are read the same way per name.
- ``loss.json`` (``GLM52_EP2_TP1_PP2/compare_loss.py`` at 2f2aa0c3027fbd9edb4a9c2bd1f07b6a685234aa): schema
  ``glm52-machine-loss/v1``, ``raw`` true, ``stage`` ``training_callback_complete``, ``framework``, ``steps``
  1..N and ``losses`` (one float64 per step, compared as IEEE-754 bit patterns).

Where ``compare_loss.py`` prints ✅/❌ per md5 and the first bad step, this gives the training level's report: per step
a verdict, per quantity how many records are bitwise equal, the first divergence in time (step, then micro-batch,
loss, rank, and within them the loss path's order: probes, per-token loss, final loss), and for a final loss whose
printed value reproduces its md5 (the float32 read back from ``val``) how many float32 ULPs apart the two are. A
record one run has and the other lacks is an error naming it (fail closed, as the gate).

Unlike compare_loss.py, every line carrying a record marker is read completely or the run is refused naming its file,
line and text: a record its patterns skip (``val=inf``, an empty md5, a line cut off) would shift every later record
of its rank by one micro-batch. ``val`` is whatever Python's ``float()`` reads (``%.20f`` prints ``inf``, ``-inf``
and ``nan``). A final loss that is not finite in both runs is an error, never a pass, even with equal bits: a gate
must not pass two diverged trainings; one not finite against a finite one is the difference it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from harness.compare.dumps import DumpError
from harness.compare.tensors import DIFF, EQUAL, MISSING, SHAPE_MISMATCH, TensorComparison, compare_tensor

SCHEMA = "glm52-machine-loss/v1"
LOSS_JSON = "loss.json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MD5 = r"md5=(?P<md5>[0-9a-fA-F]{32})(?![0-9A-Za-z_])"  # a whole md5: 32 hex digits, not cut off or run on
PER_TOKEN = re.compile(r"per_token_loss:\s*rank=(?P<rank>\d+)\s+shape=\[(?P<shape>[^\]]*)\]\s+" + MD5)
FINAL = re.compile(r"final_loss:\s*rank=(?P<rank>\d+)\s+val=(?P<val>\S+)\s+" + MD5)
PROBE = re.compile(r"\[LOSS_PATH_MD5\]\s*rank=(?P<rank>\d+)\s+(?P<name>\S+)\s+shape=\[(?P<shape>[^\]]*)\]\s+" + MD5)
# Where a record starts: each one must then match its pattern from there (several prints may share a line)
MARKER = re.compile(r"(?<!\w)(?:per_token_loss:|final_loss:)|\[LOSS_PATH_MD5\]")
RECORDS = {"[LOSS_PATH_MD5]": ("loss_path", PROBE, "[LOSS_PATH_MD5] rank=R NAME shape=[..] md5=H"),
           "per_token_loss:": ("per_token_loss", PER_TOKEN, "per_token_loss: rank=R shape=[..] md5=H"),
           "final_loss:": ("final_loss", FINAL, "final_loss: rank=R val=V md5=H")}
# A step's records in the order the loss is made: the probes along the loss path, the per-token loss, the final loss
ORDER = ("loss", "loss_path", "per_token_loss", "final_loss")
NON_FINITE = "NON_FINITE"  # a final loss that is inf or nan in both runs: an ERROR, whatever its bits
WHAT = {"log": "loss only: PaddleFleet alignment logs (per_token_loss / final_loss md5 per rank and micro-batch)",
        "loss.json": f"loss only: {LOSS_JSON} ({SCHEMA}: the main loss of each step as a float64)"}


class LossLogError(DumpError):
    """A loss log or loss.json that cannot be read; the message names the file, the line or field, and the value."""


class Record(NamedTuple):
    """One printed loss anchor: `key` orders it in time (step, micro-batch, loss, rank, quantity, probe index);
    `value` the float32 (final loss) or float64 (loss.json) it carries where its bits are known, else None (compared
    by md5)."""

    name: str
    key: tuple
    md5: str
    shape: tuple[int, ...]
    value: np.ndarray | None
    shown: str  # the printed value (final_loss's val), or ""
    where: str  # file:line
    series: str  # the records numbered with it, e.g. "rank 1 final_loss" (a missing one says how many it has)


class LossRun(NamedTuple):
    path: Path
    kind: str  # "log" or "loss.json"
    records: dict[str, Record]
    steps: int
    about: dict  # what the file says of itself (loss.json: framework), or the files read
    printed: dict[str, tuple[int, str]]  # series -> how many records it has, where its last one is


def is_loss_run(path: Path) -> bool:
    path = Path(path)
    return path.is_file() or (path.is_dir() and ((path / LOSS_JSON).is_file() or bool(log_files(path))))


def log_files(folder: Path) -> list[Path]:
    """The log files compare_loss.py reads in a folder: ``workerlog.*``, ``*.log``, ``*.out``, by name."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file()
                  and (p.name.startswith("workerlog.") or p.name.endswith((".log", ".out"))))


def read(path, micro_batches: int = 1, losses: tuple[str, ...] = ("main",)) -> LossRun:
    """A loss-only run: a loss.json (or a folder holding one), a log file, or a folder of log files. A folder of run
    folders is refused (compare_loss.py's newest-subfolder guess could compare a stale run)."""
    path = Path(path)
    if micro_batches < 1:
        raise LossLogError(f"--micro-batches must be at least 1 (got {micro_batches})")
    if not losses or len(set(losses)) != len(losses):
        raise LossLogError(f"the losses per micro-batch must be distinct names, like main,mtp (got {list(losses)})")
    if path.is_dir() and (path / LOSS_JSON).is_file():
        return read_loss_json(path / LOSS_JSON)
    if path.is_file() and path.suffix == ".json":
        return read_loss_json(path)
    if path.is_file():
        return read_logs([path], path, micro_batches, losses)
    if path.is_dir():
        files = log_files(path)
        if files:
            return read_logs(files, path, micro_batches, losses)
        raise LossLogError(f"{path}: no {LOSS_JSON}, no step folder (steps/) and no log file (workerlog.*, *.log, "
                           "*.out); give the run's own folder, not a folder of runs")
    raise LossLogError(f"{path} does not exist")


def read_logs(files: list[Path], path: Path, micro_batches: int, losses: tuple[str, ...]) -> LossRun:
    seen: dict[tuple, list[tuple[dict, str]]] = {}  # (rank, quantity, probe name) -> records in print order
    for file in files:
        try:
            text = file.read_text(encoding="utf-8", errors="ignore")
        except OSError as error:
            raise LossLogError(f"{file}: cannot read: {error}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if "_loss:" not in line and "LOSS_PATH_MD5" not in line:
                continue
            for quantity, fields in _parse(ANSI.sub("", line), f"{file}:{number}"):
                seen.setdefault((fields["rank"], quantity, fields.get("name") or ""), []).append(
                    (fields, f"{file}:{number}"))
    if not any(q != "loss_path" for _, q, _ in seen):
        raise LossLogError(f"{path}: no per_token_loss or final_loss line in {len(files)} file(s) "
                           f"({', '.join(f.name for f in files[:5])}): is the accuracy-compatible logging on "
                           "(FLAGS_use_accuracy_compatible_kernel / use_accuracy_compatible)?")
    probes = {}  # probe name -> its rank in the order first printed
    for _, quantity, probe in seen:
        if quantity == "loss_path":
            probes.setdefault(probe, len(probes))
    per_step = micro_batches * len(losses)
    records, steps, printed = {}, 0, {}
    for (rank, quantity, probe), matches in seen.items():
        series = f"rank {rank} {quantity}" + (f" {probe}" if probe else "")
        printed[series] = (len(matches), matches[-1][1])
        for i, (fields, where) in enumerate(matches):
            step, rest = i // per_step + 1, i % per_step
            mb, loss = rest // len(losses), losses[rest % len(losses)]
            steps = max(steps, step)
            name = f"step{step}.{quantity}." + (f"{probe}." if probe else "") + f"rank{rank}.mb{mb}" + (
                f".{loss}" if len(losses) > 1 else "")
            key = (step, mb, sorted(losses).index(loss), rank, ORDER.index(quantity), probes.get(probe, 0))
            records[name] = _record(name, key, fields, where, series)
    _whole_steps(path, printed, per_step)
    return LossRun(path, "log", dict(sorted(records.items(), key=lambda item: item[1].key)), steps,
                   {"files": [str(f) for f in files], "micro_batches": micro_batches, "losses": list(losses)},
                   printed)


def _whole_steps(path: Path, printed: dict[str, tuple[int, str]], per_step: int) -> None:
    """Every series ends on a whole step and every rank's losses end on the same step: a run cut off inside a step (or
    read with another --micro-batches / --losses than it printed) would otherwise compare a part of a step as if whole,
    and pass where both runs stop at the same record."""
    for series, (count, last) in printed.items():
        if count % per_step:
            raise LossLogError(f"{path}: {series} printed {count} records, not a whole number of steps of {per_step} "
                               f"(micro-batches x losses per step; the last at {last}): a run cut off inside a step, "
                               "or --micro-batches / --losses other than what it printed")
    counts = {series: count for series, (count, _) in printed.items() if "loss_path" not in series}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{series} {count}" for series, count in counts.items())
        raise LossLogError(f"{path}: its ranks printed different numbers of loss records ({listed}): a rank that "
                           "stopped early, or logs of another run mixed in")


def _parse(line: str, where: str) -> list[tuple[str, dict]]:
    """Every record a line prints, each read whole: (quantity, fields with rank, shape, md5 and val read)."""
    found = []
    for marker in MARKER.finditer(line):
        quantity, pattern, form = RECORDS[marker.group()]
        match = pattern.match(line, marker.start())
        if match is None:
            raise LossLogError(f"{where}: a {quantity} record that does not read as `{form}` (H: 32 hex digits), "
                               f"so every later record of its rank would shift: {line.strip()!r}")
        fields = {**match.groupdict(), "rank": int(match["rank"]), "md5": match["md5"].lower()}
        if "shape" in fields:
            fields["shape"] = _shape(fields["shape"], where, line)
        if "val" in fields:
            try:
                fields["number"] = float(fields["val"])
            except ValueError:
                raise LossLogError(f"{where}: final_loss val={fields['val']!r} is not a number: "
                                   f"{line.strip()!r}") from None
        found.append((quantity, fields))
    return found


def _record(name: str, key: tuple, fields: dict, where: str, series: str) -> Record:
    if "val" not in fields:
        return Record(name, key, fields["md5"], fields["shape"], None, "", where, series)
    value = np.array([fields["number"]], dtype=np.float32)
    # the float32 the printed value reads back as: its bits are the logged ones only where it reproduces the md5
    known = hashlib.md5(value.tobytes()).hexdigest() == fields["md5"]
    return Record(name, key, fields["md5"], (1,), value if known else None, fields["val"], where, series)


def _shape(text: str, where: str, line: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise LossLogError(f"{where}: shape=[{text}] is not a list of integers: {line.strip()!r}") from None


def read_loss_json(path: Path) -> LossRun:
    """``loss.json`` checked as the gate checks it (fail closed), each error naming the file, field and value."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LossLogError(f"{path}: not readable JSON: {error}") from None
    if not isinstance(data, dict):
        raise LossLogError(f"{path}: the root must be an object (got {type(data).__name__})")
    expected = {"schema": SCHEMA, "raw": True, "stage": "training_callback_complete"}
    for field, value in expected.items():
        if data.get(field) != value:
            raise LossLogError(f"{path}: field {field!r} must be {value!r} (got {data.get(field)!r})")
    steps, losses = data.get("steps"), data.get("losses")
    if not isinstance(steps, list) or not isinstance(losses, list) or not steps or len(steps) != len(losses):
        raise LossLogError(f"{path}: fields 'steps' and 'losses' must be non-empty lists of one length (got "
                           f"{_length(steps)} and {_length(losses)})")
    if steps != list(range(1, len(steps) + 1)) or any(isinstance(s, bool) for s in steps):
        raise LossLogError(f"{path}: field 'steps' must be 1..{len(steps)} in order (got {steps[:10]!r})")
    records = {}
    for step, loss in zip(steps, losses, strict=True):
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise LossLogError(f"{path}: field 'losses' at step {step}: {loss!r} is not a finite number")
        value = np.array([float(loss)], dtype=np.float64)
        name = f"step{step}.loss"
        records[name] = Record(name, (step, 0, 0, 0, 0, 0), hashlib.md5(value.tobytes()).hexdigest(), (1,), value,
                               repr(float(loss)), f"{path} losses[{step - 1}]", "loss")
    return LossRun(path, "loss.json", records, len(steps), {"framework": data.get("framework"), "file": str(path)},
                   {"loss": (len(steps), f"{path} losses[{len(steps) - 1}]")})


def _length(value) -> str:
    return f"{len(value)} entries" if isinstance(value, list) else repr(value)


def compare(a: LossRun, b: LossRun) -> tuple[list[TensorComparison], dict]:
    """(one comparison per record, in time order; the training level's summary along time, loss only)."""
    if a.kind != b.kind:
        raise LossLogError(f"{a.path} is a {a.kind} run and {b.path} a {b.kind} run: compare two of one kind")
    names = sorted({*a.records, *b.records}, key=lambda n: (a.records.get(n) or b.records[n]).key)
    rows = [_compare(name, a.records.get(name), b.records.get(name), (a, b)) for name in names]
    steps = []
    for step in range(1, max(a.steps, b.steps) + 1):
        mine = [row for row in rows if row.name.startswith(f"step{step}.")]
        steps.append(_summarise(step, mine, a, b))
    first = next((s for s in steps if s["first_divergence"]), None)
    order = [q for q in ORDER if any(q in s["quantities"] or q in s["scalars"] for s in steps)]
    return rows, {
        "steps": steps, "parameters": 0, "steps_kept": [], "order": order, "truth": {},
        "first_divergence": ({"step": first["step"], "quantity": first["first_divergence"].split(".")[1],
                              "tensor": first["first_divergence"]} if first else None),
        "loss_only": {"kind": a.kind, "what": WHAT[a.kind], "a": a.about, "b": b.about},
    }


def _compare(name: str, a: Record | None, b: Record | None, runs: tuple[LossRun, LossRun]) -> TensorComparison:
    if a is None or b is None:
        held, (label, other), run = (a, "AB", runs[1]) if a else (b, "BA", runs[0])
        count, last = run.printed.get(held.series, (0, ""))
        has = f"{count} {held.series} records (the last at {last})" if count else f"no {held.series} record"
        return TensorComparison(name, MISSING, note=f"only run {label} has it ({held.where}); run {other} has {has}: "
                                                    "it ended earlier or printed fewer")
    where = f"A {a.where}, B {b.where}"
    if a.shape != b.shape:
        return TensorComparison(name, SHAPE_MISMATCH, note=f"shape {list(a.shape)} vs {list(b.shape)} ({where})")
    if _not_finite(a) and _not_finite(b):
        return TensorComparison(name, NON_FINITE, shape=list(a.shape),
                                note=f"non-finite loss in both runs: A {a.shown} at {a.where}, B {b.shown} at "
                                     f"{b.where}")
    if a.value is not None and b.value is not None:
        row = compare_tensor(name, a.value, b.value)
        row.note = f"{a.shown} vs {b.shown} ({where})"
        return row
    status = EQUAL if a.md5 == b.md5 else DIFF
    shown = f"val {a.shown} vs {b.shown}; " if a.shown else ""
    return TensorComparison(name, status, shape=list(a.shape), note=f"{shown}compared by md5 "
                                                                    f"({a.md5[:12]} vs {b.md5[:12]}; {where})")


def _not_finite(record: Record) -> bool:
    return bool(record.shown) and not math.isfinite(float(record.shown))


def _summarise(step: int, rows: list[TensorComparison], a: LossRun, b: LossRun) -> dict:
    scalars = {}
    for row in rows:
        if row.name.split(".")[1] == "loss":  # loss.json: one scalar a step, shown as the training level shows its loss
            va, vb = a.records.get(row.name), b.records.get(row.name)
            scalars["loss"] = {"a": float(va.value[0]) if va else None, "b": float(vb.value[0]) if vb else None,
                               "equal": row.status == EQUAL if va and vb else None, "unit": "float64 ULP",
                               "ulps": float(row.max_ulp) if row.status in (EQUAL, DIFF) else None,
                               "note": "" if va and vb else f"not written by run {'B' if va else 'A'}"}
    return step_summary(step, rows, scalars, ORDER)


def step_summary(step: int, rows: list[TensorComparison], scalars: dict | None = None, order=None) -> dict:
    """One step of a run compared record by record (loss logs, hook dumps), as the training level's per-step table
    reads it: its verdict (ERROR where a record is missing, misshapen or not finite: no verdict of bits), its first
    differing record, and per quantity (``step{k}.<quantity>...``; those in `scalars` aside, in `order` where given)
    how many records are equal and the first 20 that differ."""
    quantities = {}
    for row in rows:
        quantity = row.name.split(".")[1]
        if quantity in (scalars or {}):
            continue
        counts = quantities.setdefault(quantity, {"equal": 0, "total": 0, "differing": []})
        counts["total"] += 1
        if row.status == EQUAL:
            counts["equal"] += 1
        elif len(counts["differing"]) < 20:
            counts["differing"].append(row.name)
    first = next((row.name for row in rows if row.status != EQUAL), None)
    verdict = ("BITWISE_PASS" if first is None else "DIFF" if all(row.status in (EQUAL, DIFF) for row in rows)
               else "ERROR")
    return {"step": step, "verdict": verdict, "first_divergence": first, "kept": False, "scalars": scalars or {},
            "quantities": quantities if order is None else {q: quantities[q] for q in order if q in quantities}}
