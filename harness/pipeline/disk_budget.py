"""The disk a case will write, checked before it starts: a case that cannot fit ends ERROR naming the space it needs
and the space there is, before anything runs (issue 47: a night that filled a disk at its 119th case ended every later
case ERROR, each after it had started).

The footprint comes from the case's own tensor specs at the shapes and tokens it runs (the same specs the memory check
sizes, ``harness.case.checkpoints.tensor_bytes``), every training step it keeps whole (a digest per tensor of the
others), and is meant to be an upper bound:

- the checkpoints folder: the case's inputs, twice (a negative control's flipped copy of a part), even when they are
  there already (over, not under);
- the reports folder: each framework side's outputs (times `repeat`; twice on several ranks: the rank files and the
  gathered ones), the truth's in float64, the re-fed runs of side b of a training case (two more sides: a float64
  case's check of every step runs them, ``--refeed`` asks for them; a float64 case runs no separate truth), and
  ``REPORT_BYTES`` for reports, pictures and logs. Step files give their zero blocks back to the disk
  (``harness.run.sparse_files``), which this does not count: a bound, not a forecast;
- a training case a night judges step by step as it runs (``harness.compare.train_follow``): of each side two steps
  whole (the one being written and the first divergence), of the truth one; with a re-feed in time, run beside the
  pair (``harness.compare.train_refeed.Beside``), one more of side a (the step the re-fed runs read) and step 1 of
  both re-fed runs (past it, one re-fed step at a time).

Both folders on one file system add up.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from harness import resources
from harness.case.checkpoints import tensor_bytes
from harness.case.registry import Case
from harness.levels import level_of

REPORT_BYTES = 64 << 20  # reports, pictures, logs and meta of one case: 17 MB measured at most (a training case)
DIGEST_BYTES = 256  # a digest-only training step's entry per tensor: its digest and layout (about 100 B)
STEP = re.compile(r"step(\d+)\.")


def footprint(case: Case, repeat: int = 1, truth: bool = True, refeed: bool = False,
              followed: bool = False) -> dict[str, int]:
    """Bytes the case writes at most, by folder: ``{"checkpoints": ..., "reports": ...}``; `refeed`: re-fed runs
    asked for (``--refeed``); `followed`: a training case judged step by step as it runs (a night's on a CPU:
    ``Level.follows``)."""
    kept = set(case.train.steps_kept) if case.train else None
    ranks = 2 if level_of(case).ranks(case) > 1 or (case.train and case.train.dp * case.train.ep > 1) else 1
    one_side = _outputs(case, kept)
    sides = 2 * repeat * ranks * one_side
    float64_train = bool(case.train) and case.dtype == "float64"
    # the float64 truth of a training case keeps each kept step and the one before it (harness.levels.train)
    oracle = (_outputs(case, kept and kept | {step - 1 for step in kept}, "float64")
              if truth and case.truth and not float64_train else 0)
    # side b re-fed from side a's state in two modes, on one rank (harness.compare.train_refeed)
    refeeding = bool(case.train) and (refeed or (float64_train and case.train.dp == 1))
    refeds = 2 * one_side if refeeding else 0
    if followed:  # harness.compare.train_follow: whole, a step being written and the pair's first divergence
        first = set(sorted(kept)[:1])
        # and of side a the step the re-fed runs beside the pair read; of theirs, step 1 of both
        sides = 2 * _outputs(case, set(sorted(kept)[:2])) + (_outputs(case, first) if refeeding else 0)
        oracle = _outputs(case, first, "float64") if oracle else 0
        refeds = 2 * _outputs(case, first) if refeeding else 0
    return {"checkpoints": 2 * tensor_bytes(case, case.input_specs()),
            "reports": sides + oracle + refeds + REPORT_BYTES}


def _outputs(case: Case, kept: set[int] | None, dtype: str | None = None) -> int:
    """One side's outputs: whole, but a training step that is not kept holds a digest per tensor (harness.run.steps)."""
    specs = case.output_specs()
    whole = [spec for spec in specs if kept is None or (step := STEP.match(spec.name)) is None or
             int(step.group(1)) in kept or math.prod(spec.shape) == 1]
    return tensor_bytes(case, whole, dtype) + DIGEST_BYTES * (len(specs) - len(whole))


def check(case: Case, reports_dir: Path, checkpoints_dir: Path, repeat: int = 1, truth: bool = True,
          refeed: bool = False, followed: bool = False) -> dict:
    """The footprint and the free space it was checked against; a StorageError naming both when it cannot fit."""
    need = footprint(case, repeat, truth, refeed, followed)
    folders = {"reports": Path(reports_dir), "checkpoints": Path(checkpoints_dir)}
    disks: dict[int, dict] = {}
    for what, folder in folders.items():
        free, device = resources.free_disk(folder)
        disk = disks.setdefault(device, {"free": free, "need": 0, "folders": []})
        disk["need"] += need[what]
        disk["folders"].append(f"{what} folder {folder}: {resources.human_bytes(need[what])}")
    for disk in disks.values():
        if disk["need"] > disk["free"]:
            raise resources.StorageError(
                f"not started: case {case.name!r} at tokens={case.tokens} needs up to "
                f"{resources.human_bytes(disk['need'])} of disk ({'; '.join(disk['folders'])}), and its disk has "
                f"{resources.human_bytes(disk['free'])} free; free some space, or run fewer tokens")
    return {"need": need, "free": {what: resources.free_disk(folder)[0] for what, folder in folders.items()}}

