"""Two training runs captured outside a comparison (``python -m harness compare-runs RUN_A RUN_B``, docs/attach.md):
what each folder holds, the case the training level compares them as, and the checks that make a comparison of two
unrelated runs an error naming the tensor or the setting instead of a table of differences. It fails closed: a run
that stopped early, a description that disagrees with its step files, another model or other training settings are
ERROR, never a shorter or a quieter comparison.

A run is a step folder: ``steps/step{k:05d}.safetensors`` (``harness.run.steps``) and ``meta.json``, as a built-in
training runner writes it (its ``request.json`` beside them says the model, dtype and training settings) or as a
recorder in the user's own loop writes it (``harness.attach``: the same step files; the description is ``meta.json``'s
``capture`` entry, in the request's fields). The comparison itself is the training level's
(``harness.compare.train_steps.compare_steps``), unchanged: this module only builds its inputs.
"""

from __future__ import annotations

import json
import re
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
STEP_FILE = re.compile(r"step(\d+)(?:\.rank\d+)?\.safetensors")  # harness.run.steps.step_file's names


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
    (``harness.run.steps.validate``), and no step file beyond them (a description behind its steps: a recorder
    stopped between the two), and no recording a recorder stopped (an error in the user's loop: ``harness.attach``'s
    ``capture.stopped``); RunError naming the file and tensor, or the step and error."""
    stopped = (run.meta.get(CAPTURE) or {}).get("stopped") if isinstance(run.meta.get(CAPTURE), dict) else None
    if stopped:
        raise RunError(f"{run.folder}: its recorder stopped recording at step {stopped.get('step')} "
                       f"({stopped.get('error')}; {META} field {CAPTURE}.stopped): the run is not whole")
    problem = steps.validate(run.folder, as_case(run))
    if problem:
        raise RunError(problem)
    beyond = sorted((number, path) for path in (run.folder / steps.STEPS_DIR).iterdir()
                    if (number := _step_number(path.name)) is not None and number > run.train.steps)
    if beyond:
        number, path = beyond[0]
        described = f"{run.source}" + (f" field {CAPTURE}" if run.source.name == META else "")
        raise RunError(f"{path} holds step {number}, but {described} describes {run.train.steps} steps: the "
                       "description and the step files disagree")


def _step_number(name: str) -> int | None:
    """step00007.safetensors, step00007.rank1.safetensors -> 7; any other name -> None."""
    match = STEP_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


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


# What a difference between the two runs' training settings (TrainSettings' fields) means (docs/attach.md). A field
# named here is listed in the report and changes nothing else; every other field changes the update (the optimizer
# and its own settings, lr, min_lr, weight decay and which parameters it applies to, clipping, the schedule, masters,
# micro-batches, the routing bias update): a difference in it is an ERROR, the bits of such runs say nothing of the
# frameworks. `steps` has its own rule (runs of different lengths: ERROR, or --steps N).
NOTED = {
    "steps_kept": "which steps keep their tensors (the others are compared by digest)",
    "dp": "data-parallel ranks over the same global batch (what training-ranks.md compares)",
    "ep": "expert-parallel ranks among them",
    "distributed_optimizer": "where the optimizer's state lives, not its update",
    "flip": "a negative control's planted bit",
    "bare": "bench_speed's unobserved run",
}
STACK_FIELD = "one stack's implementation choice of the same update (an optimizer's stack field)"
NOT_FOR_TRUTH = ("master_weights",)  # the truth is float64: no masters, whatever the runs' dtype
# weight_decay_params "default" is each stack's own choice (harness.case.train_settings.WEIGHT_DECAY_PARAMS), by the
# framework a built-in runner's meta.json names: Megatron-Core exempts the 1-D parameters (norms, biases)
DEFAULT_DECAY = {"megatron-core": "not_1d", "pytorch": "all", "paddle": "all"}


def comparison_case(a: CapturedRun, b: CapturedRun, truth: CapturedRun | None = None,
                    steps: int | None = None) -> tuple[Case, list[str]]:
    """(the case both runs are compared as, notes for the report). Both must hold the same tensors in the same
    dtypes and shapes (RunError naming the first tensor that differs otherwise), be of the same model and training
    settings (RunError listing every field that changes the update, with both values; ``NOTED``'s are notes), and
    have the same number of steps unless `steps` (--steps N) asks for steps 1..N of both. A truth run must hold the
    same tensors and settings (its dtype and masters aside) and at least as many steps."""
    mine, theirs = layouts(a, a.train), layouts(b, b.train)
    for name in [*mine, *(n for n in theirs if n not in mine)]:
        if mine.get(name) != theirs.get(name):
            families = (f" (run A trains {a.family}, run B {b.family})" if a.family != b.family else "")
            raise RunError(f"runs {a.folder} and {b.folder} do not hold the same state{families}: tensor "
                           f"{name!r} is {_layout(mine.get(name))} in run A (as {a.source} describes it) and "
                           f"{_layout(theirs.get(name))} in run B (as {b.source} describes it)")
    count = compared_steps(a, b, steps)
    errors, notes = differences(a, b)
    if errors:
        raise RunError(f"runs {a.folder} and {b.folder} were not trained alike, so their bits say nothing of the "
                       f"frameworks: {'; '.join(errors)} (as {a.source} and {b.source} describe them)")
    notes += [f"run {label} has {run.train.steps} steps: steps 1 to {count} compared (--steps {count}), "
              f"{count + 1} to {run.train.steps} not" for label, run in (("A", a), ("B", b)) if run.train.steps > count]
    kept = tuple(s for s in a.train.steps_kept if s in b.train.steps_kept and s <= count)
    digested = [s for s in range(1, count + 1) if s not in kept]
    if digested:
        notes.append(f"steps {', '.join(map(str, digested))}: state tensors compared by digest (equal or not, no "
                     f"distances): run A keeps steps {_kept(a, count)}, run B {_kept(b, count)}")
    if not a.train.clip_grad:
        notes.append("clip factors not compared: neither run clips (clip_grad 0)")
    for label, run in (("A", a), ("B", b)):
        notes += recorder_notes(run, label, count)
    if truth is not None:
        check_truth(truth, a, mine, count)
    train = replace(a.train, steps=count, steps_kept=kept, flip=None)
    case = as_case(a, f"{a.folder.name} vs {b.folder.name}", train, (a.runner, b.runner))
    return case, notes


def recorder_notes(run: CapturedRun, label: str, count: int) -> list[str]:
    """What a recorder wrote beside its steps (harness.attach), as notes: the optimizer flags it listed, and the
    parameters it found without a gradient (written as zeros), per compared step."""
    capture = run.meta.get(CAPTURE) if isinstance(run.meta.get(CAPTURE), dict) else {}
    notes = []
    flags = (capture.get("not_described") or {}).get("optimizer_flags")
    if flags:
        notes.append(f"run {label}: optimizer flags its record does not carry (the same math): "
                     + ", ".join(f"{flag}={value}" for flag, value in flags.items()))
    absent = {f"step {s['step']}": s["without_grad"] for s in capture.get("steps", []) if s.get("without_grad")}
    absent.update(run.meta.get("zero_grads") or {})  # the Paddle recorder's and the built-in runners' own key
    for step, names in absent.items():
        if names and int(step.split()[-1]) <= count:
            notes.append(f"run {label}, {step}: {len(names)} parameter(s) without a gradient, written as zeros: "
                         f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    return notes


def differences(a: CapturedRun, b: CapturedRun, fields_aside=()) -> tuple[list[str], list[str]]:
    """(the differences that make a comparison meaningless, those only listed): each "field: A's value in run A, B's
    in run B", the model's config (``config.model``) and every training setting but the number of steps."""
    models = [model_config(run.model).to_dict() for run in (a, b)]
    errors = [f"config.model.{key}: {_value(models[0], key)} in run A, {_value(models[1], key)} in run B"
              for key in [*models[0], *(k for k in models[1] if k not in models[0])]
              if models[0].get(key) != models[1].get(key)]
    decay_errors, notes = _decay(a, b)
    errors += decay_errors
    settings = [_settings(run.train) for run in (a, b)]
    stack_fields = {*a.train.record.stack_fields, *b.train.record.stack_fields}
    both_constant = {a.train.decay_style, b.train.decay_style} == {"constant"}
    for key in [*settings[0], *(k for k in settings[1] if k not in settings[0])]:
        if key in ("steps", "weight_decay_params", *fields_aside) or settings[0].get(key) == settings[1].get(key):
            continue
        text = f"{key}: {_value(settings[0], key)} in run A, {_value(settings[1], key)} in run B"
        if key in NOTED or key in stack_fields:
            notes.append(f"{text} ({NOTED.get(key, STACK_FIELD)})")
        elif key == "decay_steps" and both_constant:
            notes.append(f"{text} (no effect: both schedules are constant)")
        else:
            errors.append(text)
    return errors, notes


def _decay(a: CapturedRun, b: CapturedRun) -> tuple[list[str], list[str]]:
    """([error], [note]) on which parameters each run decays, where they differ in name or in fact: a note where the
    same parameters decay, or where two built-in runs say "default" (each stack's own choice, as compare runs
    them); else an error."""
    named = [run.train.weight_decay_params for run in (a, b)]
    decayed = [decayed_params(run) for run in (a, b)]
    if named[0] == named[1] and decayed[0] == decayed[1]:
        return [], []
    shown = [f"{name!r}" + (f" ({run.meta.get('framework')}'s own: {held!r})" if held != name else "")
             for name, held, run in zip(named, decayed, (a, b), strict=True)]
    text = f"weight_decay_params: {shown[0]} in run A, {shown[1]} in run B"
    if decayed[0] == decayed[1]:
        return [], [f"{text}: the same parameters decay"]
    if named == ["default", "default"] and "default" not in decayed:
        return [], [f"{text}: each stack's own choice, as compare runs them"]
    return [text], []


def decayed_params(run: CapturedRun) -> str:
    """Which parameters the run decays: its weight_decay_params, where a built-in runner's request says "default"
    the choice of that runner's stack (``DEFAULT_DECAY``); a recorder's "default" (neither choice) stays."""
    value = run.train.weight_decay_params
    if value == "default" and run.source.name == REQUEST:
        return DEFAULT_DECAY.get(run.meta.get("framework"), value)
    return value


def _settings(train: TrainSettings) -> dict:
    """The settings as compared: the request's fields, the optimizer always named."""
    return {**train.to_dict(), "optimizer": train.record.name}


def _value(values: dict, key: str) -> str:
    return repr(values[key]) if key in values else "absent"


def compared_steps(a: CapturedRun, b: CapturedRun, steps: int | None) -> int:
    """How many steps are compared: every step of two runs of the same length, or the first `steps` of both. A run
    that stopped early is an ERROR, not a shorter comparison."""
    if steps is None:
        if a.train.steps != b.train.steps:
            raise RunError(f"the runs have different lengths: run A ({a.folder}) ends at step {a.train.steps}, run B "
                           f"({b.folder}) ends at step {b.train.steps} (as {a.source} and {b.source} describe them); a "
                           "run that stopped early is not a pass: --steps N compares steps 1 to N of both")
        return a.train.steps
    if steps < 1:
        raise RunError(f"--steps {steps}: must be >= 1")
    for label, run in (("A", a), ("B", b)):
        if run.train.steps < steps:
            raise RunError(f"--steps {steps}: run {label} ({run.folder}) ends at step {run.train.steps} (as "
                           f"{run.source} describes it)")
    return steps


def check_truth(truth: CapturedRun, run: CapturedRun, layout: dict, count: int) -> None:
    """The truth run holds every tensor of the runs (a master as a parameter), was trained as they were (its dtype
    and masters aside) and has their `count` steps; RunError naming the tensor, the fields or the steps."""
    expected = layouts(truth, truth.train)
    for name, (_, shape) in layout.items():
        held = expected.get(name.replace(".master.", ".param.", 1))
        if held is None or held[1] != shape:
            raise RunError(f"truth run {truth.folder} does not hold {name!r} as {list(shape)} (as "
                           f"{truth.source} describes it: {_layout(held)})")
    errors, _ = differences(run, truth, NOT_FOR_TRUTH)
    if errors:
        wording = "; ".join(error.replace("in run B", "in the truth") for error in errors)
        raise RunError(f"truth run {truth.folder} was not trained as the runs were: {wording} (as {run.source} and "
                       f"{truth.source} describe them)")
    if truth.train.steps < count:
        raise RunError(f"truth run {truth.folder} has {truth.train.steps} steps; the runs compare {count}")


def _kept(run: CapturedRun, count: int) -> str:
    return ", ".join(str(s) for s in run.train.steps_kept if s <= count) or "none"


def _layout(layout) -> str:
    return "absent" if layout is None else f"{layout[0]}{list(layout[1])}"
