"""Two training runs captured outside a comparison (``python -m harness compare-runs RUN_A RUN_B``, docs/attach.md):
what each folder holds, the case the training level compares them as, and the checks that make a comparison of two
unrelated runs an error naming the tensor instead of a table of differences.

A run is a step folder: ``steps/step{k:05d}.safetensors`` (``harness.run.steps``) and ``meta.json``, as a built-in
training runner writes it (its ``request.json`` beside them says the model, dtype and training settings) or as a
recorder in the user's own loop writes it (``harness.attach``: the same step files; the description is ``meta.json``'s
``capture`` entry, in the request's fields). The comparison itself is the training level's
(``harness.compare.train_steps.compare_steps``), unchanged: this module only builds its inputs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from harness.case.ops import train_step_outputs
from harness.case.registry import Case
from harness.case.specs import resolve_dtype
from harness.case.train_settings import TrainSettings
from harness.compare.dumps import DumpError
from harness.families import ModelConfigError, model_config
from harness.run import steps
from harness.run.orchestrate import SideResult
from harness.run.protocol import META

REQUEST = "request.json"  # a built-in runner's request, beside its step files
CAPTURE = steps.CAPTURE  # meta.json's entry a recorder writes: the request's fields for a run no request started
DESCRIBED = ("dtype", "config")  # what a run's description must hold (config: {"model", "train"})
SCALARS = ("grad_norm", "clip_coeff")  # written by one stack and not another (clipping off): never a layout error


class RunError(DumpError):
    """A captured run that cannot be read or compared with the other; the message names the file, the field or the
    tensor, and the value. A DumpError: every command treats it as an unreadable input (ERROR, its message)."""


class CapturedRun(NamedTuple):
    """One run's step folder and what it says it is: `source` is the file the description came from (request.json
    or meta.json), `runner` who wrote the steps (a built-in runner, or a recorder: ``hf_trainer`` ...)."""

    folder: Path
    source: Path
    runner: str
    dtype: str
    tokens: int | None
    device: str
    model: dict  # the wire config.model (family and the family's config keys)
    train: TrainSettings
    meta: dict

    @property
    def family(self) -> str:
        return model_config(self.model).family

    def side(self, label: str) -> SideResult:
        """The run as a side of the training level's comparison."""
        return SideResult(label, self.runner, "ok", self.folder, self.meta.get("executable", ""), meta=self.meta)


def is_step_run(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / steps.STEPS_DIR).is_dir()


def read(folder) -> CapturedRun:
    """The run in `folder` (a step folder), its description checked; RunError naming the file and field."""
    folder = Path(folder)
    meta_path = folder / META
    if not is_step_run(folder):
        raise RunError(f"{folder}: not a captured training run (no {steps.STEPS_DIR}/ folder of step files)")
    meta = _json(meta_path)
    request_path = folder / REQUEST
    if request_path.exists():
        source, described = request_path, _json(request_path)
    elif isinstance(meta.get(CAPTURE), dict):
        source, described = meta_path, meta[CAPTURE]
    else:
        raise RunError(f"{folder}: neither {REQUEST} (a built-in runner's) nor a {CAPTURE!r} entry in {META} (a "
                       "recorder's) says which model and training settings its steps are of")
    where = f"{source}" + (f" field {CAPTURE}" if source == meta_path else "")
    for key in DESCRIBED:
        if key not in described:
            raise RunError(f"{where}: lacks field {key!r}")
    config = described["config"]
    if not isinstance(config, dict) or not {"model", "train"} <= set(config):
        got = sorted(config) if isinstance(config, dict) else config
        raise RunError(f"{where}: field 'config' must hold 'model' and 'train' (got {got!r})")
    try:
        model_config(config["model"])
    except (ModelConfigError, KeyError, TypeError, ValueError) as error:
        raise RunError(f"{where}: field config.model: {error}") from None
    try:
        train = TrainSettings.from_dict(config["train"])
    except (ValueError, KeyError, TypeError) as error:
        raise RunError(f"{where}: field config.train: {error}") from None
    runner = meta.get("runner") or described.get("runner") or "unknown"
    return CapturedRun(folder, source, runner, described["dtype"], described.get("tokens"),
                       described.get("device") or meta.get("device", "cpu"), config["model"], train, meta)


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError(f"{path} is missing") from None
    except (OSError, json.JSONDecodeError) as error:
        raise RunError(f"{path}: not readable JSON: {error}") from None
    if not isinstance(data, dict):
        raise RunError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def as_case(run: CapturedRun, name: str = "", train: TrainSettings | None = None, runners=None) -> Case:
    """The training case a run's description amounts to (what the training level's checks and comparison read)."""
    train = train or run.train
    return Case(name=name or run.folder.name, source=run.source, description="", family="train",
                op="causal_lm_train", dtype=run.dtype, tp=1, seed=0, tokens=run.tokens or 0, shapes={},
                config={"model": run.model, "train": train.to_dict()}, tensors={},
                runners=tuple(runners or (run.runner, run.runner)), devices=(run.device,), truth=False)


def check(run: CapturedRun) -> None:
    """Every step file the run's description promises, every kept tensor and every digest, in its dtype and shape
    (``harness.run.steps.validate``); RunError naming the file and tensor."""
    problem = steps.validate(run.folder, as_case(run))
    if problem:
        raise RunError(problem)


def ranks(run: CapturedRun) -> dict | None:
    """Whether every rank of a run on several ranks ended every step with rank 0's state
    (``harness.run.steps.ranks_agree``, what a comparison records for its own sides): the run's own record where it
    has one (a built-in runner's meta.json), else checked here; None on one rank. RunError where a rank's file is
    missing or unreadable."""
    world = int(run.meta.get("world_size") or 1)
    if world == 1:
        return None
    if "ranks_agree" in run.meta:
        return run.meta["ranks_agree"]
    checks = steps.ranks_agree(run.folder, as_case(run), world)
    if "problem" in checks:
        raise RunError(f"{run.folder} ran on {world} ranks ({META} field world_size): {checks['problem']}")
    return checks


def layouts(run: CapturedRun, train: TrainSettings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of one step's outputs as the run's description gives them (step 1's names)."""
    m = model_config(run.model)
    return {spec.name: (resolve_dtype(spec.dtype, run.dtype), tuple(spec.shape))
            for spec in train_step_outputs(m, train, 1) if spec.name.split(".", 1)[1] not in SCALARS}


def comparison_case(a: CapturedRun, b: CapturedRun, truth: CapturedRun | None = None) -> tuple[Case, list[str]]:
    """(the case both runs are compared as, notes for the report). Both must hold the same tensors in the same
    dtypes and shapes (same family, widths, micro-batches, optimizer state, masters); RunError naming the first
    tensor that differs otherwise. The steps both have are compared; kept steps are those both kept; a clip factor
    only where both clipped at the same norm."""
    notes = []
    mine, theirs = layouts(a, a.train), layouts(b, b.train)
    for name in [*mine, *(n for n in theirs if n not in mine)]:
        if mine.get(name) != theirs.get(name):
            families = (f" (run A trains {a.family}, run B {b.family})" if a.family != b.family else "")
            raise RunError(f"runs {a.folder} and {b.folder} do not hold the same state{families}: tensor "
                           f"{name!r} is {_layout(mine.get(name))} in run A (as {a.source} describes it) and "
                           f"{_layout(theirs.get(name))} in run B (as {b.source} describes it)")
    count = min(a.train.steps, b.train.steps)
    if a.train.steps != b.train.steps:
        notes.append(f"run A has {a.train.steps} steps, run B {b.train.steps}: steps 1 to {count} compared")
    kept = tuple(s for s in a.train.steps_kept if s in b.train.steps_kept and s <= count)
    clip = a.train.clip_grad if a.train.clip_grad == b.train.clip_grad else 0.0
    if a.train.clip_grad != b.train.clip_grad:
        notes.append(f"run A clips the gradients' global norm at {a.train.clip_grad or 'off'}, run B at "
                     f"{b.train.clip_grad or 'off'}: clip factors not compared")
    train = replace(a.train, steps=count, steps_kept=kept, clip_grad=clip, flip=None)
    if truth is not None:
        expected = {n: layout for n, layout in layouts(truth, truth.train).items()}
        for name, (_, shape) in mine.items():
            held = expected.get(name.replace(".master.", ".param.", 1))
            if held is None or held[1] != shape:
                raise RunError(f"truth run {truth.folder} does not hold {name!r} as {list(shape)} (as "
                               f"{truth.source} describes it: {_layout(held)})")
        if truth.train.steps < count:
            raise RunError(f"truth run {truth.folder} has {truth.train.steps} steps; the runs compare {count}")
    case = as_case(a, f"{a.folder.name} vs {b.folder.name}", train, (a.runner, b.runner))
    return case, notes


def _layout(layout) -> str:
    return "absent" if layout is None else f"{layout[0]}{list(layout[1])}"
