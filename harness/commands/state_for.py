"""``python -m harness state-for RUN_A --step k --as RUN_B --out DIR``: run A's state after step k, for run B's loop to
start step k + 1 from (the re-feed into a user's loop, docs/attach.md). Framework-free: it copies bytes.

The state folder holds exactly what the built-in re-feed in time loads (``harness.runners.torch.train_state.
load_state``), as a step folder: ``steps/step{k}.safetensors`` with every tensor step k hands to step k + 1 that run
B keeps (the parameters, the masters where B trains them, the state of B's optimizer record, the routing biases),
copied byte for byte from run A's step file in canonical names, and ``steps/step{k+1}.safetensors`` with run A's lr of
step k + 1; ``state.json`` says whose state it is, after which step, and for which run. Run B's recorder
(``load_state``) puts it into B's own tensors through B's name map, with the inverse rules the built-in re-feed uses:
that is where B's names and layout (HF's, Megatron's fused ``linear_qkv`` and its distributed optimizer's ranges)
are made, from the model and optimizer B's loop holds. The step counters stay B's own: B has made k steps too.

It fails closed (``RunError`` naming the run, the file, the field or the tensor): runs of another model, dtype,
optimizer or masters setting, a step A did not keep whole, a step without a next one in A, an existing folder.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

from harness.case import tensorfile
from harness.case.ops import carried_quantities, train_buffer_names, train_state_names
from harness.compare.captured_runs import CapturedRun, RunError, check, read
from harness.families import model_config
from harness.run.steps import STATE_ABOUT, STEPS_DIR, step_file


def add_parser(commands) -> None:
    parser = commands.add_parser("state-for", help="write run A's state after step k for run B's recorder to load "
                                                   "before step k + 1 (the re-feed into your own loop)")
    parser.add_argument("a", type=Path, help="run A: a step folder that kept step k's tensors")
    parser.add_argument("--step", type=int, required=True, metavar="K", help="the step whose state is written")
    parser.add_argument("--as", dest="b", type=Path, required=True, metavar="RUN_B",
                        help="run B: the step folder of the loop that will load it (its model, dtype, optimizer "
                             "and masters are checked against run A's)")
    parser.add_argument("--out", type=Path, required=True, help="the new state folder (never overwritten)")


def main(args) -> int:
    """Exit 0 with the folder written, or 2 with the reason (a missing or unfitting input)."""
    try:
        said = write(args.a, args.step, args.b, args.out)
    except RunError as error:
        print(f"state-for: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: run A's state after step {said['step']} ({said['tensors']} tensors) and its lr of step "
          f"{said['step'] + 1}, for {said['for']}")
    return 0


def write(run_a: Path, step: int, run_b: Path, out: Path) -> dict:
    """Run A's state after `step`, for run B, in the new folder `out`; returns what state.json says."""
    a, b = read(run_a), read(run_b)
    check(a)
    _same_training(a, b)
    if not 1 <= step < a.train.steps:
        raise RunError(f"--step {step}: run A ({a.folder}) has steps 1 to {a.train.steps}; the state after step k "
                       f"needs step k + 1's lr from it, so k is 1 to {a.train.steps - 1}")
    if step >= b.train.steps:
        raise RunError(f"--step {step}: run B ({b.folder}) has {b.train.steps} steps; re-fed at step {step + 1} it "
                       "has no such step to compare")
    out = Path(out)
    if out.exists():
        raise RunError(f"--out {out} exists: a state folder is never overwritten; give a new folder")
    names = [f"step{step}.{name}" for name in wanted(b)]
    source = step_file(a.folder, step)
    held, _ = tensorfile.read_header(source)
    missing = [name for name in names if name not in held]
    if missing:
        raise RunError(f"{source} lacks {missing[0]} ({len(missing)} of {len(names)} state tensors missing): run A "
                       f"did not keep step {step}'s tensors; record it with steps_kept including {step} "
                       f"(steps_kept={a.meta.get('steps_kept')!r} in {a.folder / 'meta.json'})")
    about = {"from": str(a.folder.resolve()), "step": step, "for": str(b.folder.resolve()), "runner": b.runner,
             "dtype": a.dtype, "model": model_config(a.model).to_dict(), "optimizer": a.train.record.name,
             "master_weights": a.train.master_weights, "tensors": len(names)}
    (out / STEPS_DIR).mkdir(parents=True)
    _copy(source, names, step_file(out, step))
    _copy(step_file(a.folder, step + 1), [f"step{step + 1}.lr"], step_file(out, step + 1))
    (out / STATE_ABOUT).write_text(json.dumps(about, indent=2, sort_keys=True))
    return about


def wanted(run: CapturedRun) -> list[str]:
    """What a step hands to the next in `run`, canonical names without the step: each carried quantity of its
    optimizer record for every trained parameter (masters only where it trains them), then the routing biases."""
    m = model_config(run.model)
    quantities = [q for q in carried_quantities(run.train.record) if q != "master" or run.train.master_weights]
    return ([f"{q}.{name}" for q in quantities for name, _ in train_state_names(m)]
            + [f"expert_bias.{name}" for name, _ in train_buffer_names(m)])


def _same_training(a: CapturedRun, b: CapturedRun) -> None:
    """The state of A fits B's loop: the same model, dtype, optimizer record and masters setting."""
    pairs = {"config.model": (model_config(a.model).to_dict(), model_config(b.model).to_dict()),
             "dtype": (a.dtype, b.dtype), "config.train.optimizer": (a.train.record.name, b.train.record.name),
             "config.train.master_weights": (a.train.master_weights, b.train.master_weights)}
    for field, (mine, theirs) in pairs.items():
        if mine != theirs:
            raise RunError(f"{field}: run A ({a.source}) has {mine!r}, run B ({b.source}) {theirs!r}: A's state "
                           "does not fit B's loop")


def _copy(source: Path, names: list[str], target: Path) -> None:
    """Tensors `names` of safetensors file `source`, byte for byte, into the new file `target`."""
    held, start = tensorfile.read_header(source)
    names = sorted(names, key=lambda n: held[n]["data_offsets"][0])  # the source's order, widest dtype first: each
    entries, offset = {}, 0  # tensor stays aligned to its element size
    for name in names:
        begin, end = held[name]["data_offsets"]
        entries[name] = {"dtype": tensorfile.CODES[held[name]["dtype"]], "shape": held[name]["shape"],
                         "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(source, "rb") as reading, open(target, "xb") as writing:
        writing.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            begin, end = held[name]["data_offsets"]
            reading.seek(start + begin)
            writing.write(reading.read(end - begin))
        writing.flush()
        os.fsync(writing.fileno())
