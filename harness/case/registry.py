"""The case registry: TOML files under ``cases/``, validated field by field into frozen ``Case`` records.

A case file holds one table per case. A case may name a ``base`` case in the same registry and
override some of its fields (tables merge key by key), so variants stay one short table each.
Every error names the file, the case, the field and the offending value.
"""

from __future__ import annotations

import difflib
import re
import threading
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import tomllib

from harness import environments, families, paths
from harness.case import tolerance as tolerance_policy
from harness.case import train_settings as train_table
from harness.case.ops import KNOBS, OPS, Op, train_state_names
from harness.case.specs import resolve_dtype

CASES_DIR = Path(__file__).resolve().parents[2] / "cases"
# A case's name becomes its checkpoint folder, checkpoints/<case>/; this folder holds the weights cases share.
SHARED_WEIGHTS = "weights"

WIDTHS = {"bfloat16": 16, "float16": 16, "float32": 32, "float64": 64}
DTYPES = tuple(WIDTHS)
TP_SIZES = (1, 2, 4, 8)
DEVICES = ("cpu", "gpu")
# torch / torch_nn: plain PyTorch with Megatron's [out, in] (TN GEMM) or Paddle's [in, out] (NN GEMM) weight layout.
# oracle: the exact result, framework-free (harness.runners.oracle).
# megatron_model: a whole Megatron-Core GPTModel (local spec) of the case's model family for op causal_lm
# (docs/model-contract.md). hf_model: HF transformers' model of the family (torch, e.g. DeepseekV3ForCausalLM,
# Glm4MoeForCausalLM); also the float64 truth of model cases. paddle_model: PaddleFormers' model of the family (CPU) /
# PaddleFleet's GPTModel (GPU).
RUNNERS = ("megatron", "paddle", "torch", "torch_nn", "oracle", "megatron_model", "hf_model", "paddle_model")
DEFAULT_RUNNERS = ("megatron", "paddle")
VERDICTS = ("BITWISE_PASS", "DIFF", "WITHIN_TOLERANCE", "NONDETERMINISTIC", "UNSUPPORTED", "ERROR")
DISTRIBUTIONS = {"normal": {"mean", "std"}, "uniform": {"low", "high"}, "randint": {"high"}}
DEFAULT_DISTRIBUTION = {
    "weight": {"dist": "normal", "mean": 0.0, "std": 0.02},
    "input": {"dist": "normal", "mean": 0.0, "std": 1.0},
    "grad": {"dist": "normal", "mean": 0.0, "std": 0.01},
}
FIELDS = {
    "description", "family", "op", "dtype", "tp", "seed", "tokens", "shapes", "config", "tensors",
    "runners", "devices", "expect", "perturb", "weights_from", "base", "tolerance", "train", "truth",
    "gpu_memory_gib",
}


class CaseError(ValueError):
    """A case file or case name that cannot be used; the message says exactly where and why."""


@dataclass(frozen=True)
class Perturbation:
    """Flip one bit of one element of one input tensor, on one side only (negative controls)."""

    side: str  # "a" or "b"
    tensor: str
    index: tuple[int, ...]
    bit: int = 0


@dataclass(frozen=True)
class Expectation:
    """What a case says its run gives. `only_differ` and `bitwise_steps` let a control state all it claims: "exactly
    these tensors differ" (within the training steps they name, every output of any other case), "these steps are
    wholly bitwise"; `ranks_agree` False when the case expects a side's ranks to end a step with other state."""

    verdict: str = "BITWISE_PASS"
    differs: tuple[str, ...] = ()  # tensors that must differ (negative controls)
    equal: tuple[str, ...] = ()  # tensors that must stay bitwise equal
    only_differ: tuple[str, ...] | None = None  # exactly these differ (in their steps, for a training case)
    bitwise_steps: tuple[int, ...] = ()  # training steps whose every tensor is bitwise equal
    ranks_agree: bool = True
    stated: bool = False  # False: the case states nothing (`expect = {}` or no table); bitwise is the goal


@dataclass(frozen=True)
class WeightImport:
    """Take checkpoint tensors from a user's safetensors file, by the file's own tensor names."""

    file: str | None  # may be given at run time instead (--weights FILE)
    tensors: dict[str, tuple[str, ...]]  # canonical name -> source names, concatenated
    concat_dim: int = 0
    package: str | None = None  # `file` is inside this installed Python package (a model shipped on PyPI)


@dataclass(frozen=True)
class Case:
    name: str
    source: Path
    description: str
    family: str
    op: str
    dtype: str
    tp: int
    seed: int
    tokens: int
    shapes: dict[str, int]
    config: dict[str, Any]
    tensors: dict[str, dict[str, Any]]  # canonical input name -> resolved distribution
    runners: tuple[str, str]
    devices: tuple[str, ...]
    expect: Expectation = field(default_factory=Expectation)
    perturb: Perturbation | None = None
    weights_from: WeightImport | None = None
    tolerance: tolerance_policy.Tolerance | None = None  # None: bitwise
    truth: bool = True  # False: the case never runs the truth (a 100-step float64 training run costs too much)
    # the GPU memory one side needs, GiB (measured); a GPU with less is refused before anything runs
    gpu_memory_gib: float | None = None

    @property
    def op_spec(self) -> Op:
        return OPS[self.op]

    @cached_property
    def model(self):
        """The model's typed config (its family's record: ``harness.families``), None for an op case. `config` keeps
        its wire form, the dict a request and a report carry."""
        return families.model_config(self.config["model"]) if "model" in self.config else None

    @cached_property
    def train(self) -> train_table.TrainSettings | None:
        """A training case's settings (None for other ops). The request carries them as ``config["train"]``
        (``TrainSettings.to_dict``), which is what this reads: one source, the wire format unchanged."""
        settings = self.config.get("train")
        return train_table.TrainSettings.from_dict(settings) if settings is not None else None

    def with_train(self, train: train_table.TrainSettings) -> Case:
        """The case with other training settings (--steps-kept, --dp, --ep)."""
        return replace(self, config={**self.config, "train": train.to_dict()})

    def with_tokens(self, tokens: int) -> Case:
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            raise CaseError(f"case {self.name!r}: tokens must be a positive integer (got {tokens!r})")
        self.check_tp(self.tp, tokens)
        moved = replace(self, tokens=tokens)
        if self.perturb:  # a negative control's planted flip must still be inside its tensor
            shape = next(spec.shape for spec in moved.input_specs() if spec.name == self.perturb.tensor)
            if not all(0 <= i < n for i, n in zip(self.perturb.index, shape, strict=True)):
                raise CaseError(f"{self.source}: case {self.name!r}: field 'perturb.index': "
                                f"{list(self.perturb.index)} is outside {self.perturb.tensor} of shape {list(shape)} "
                                f"at tokens={tokens}")
        return moved

    def with_runners(self, runners: tuple[str, str]) -> Case:
        """Another pair of runners. The case's stated expectation was about its own pair, so it is kept only for a
        negative control (whose expected differences come from the planted bit flip); otherwise bitwise."""
        bad = [r for r in runners if r not in RUNNERS]
        if len(runners) != 2 or bad:
            raise CaseError(f"case {self.name!r}: runners must be two of {', '.join(RUNNERS)} "
                            f"(got {','.join(runners)!r})")
        if tuple(runners) == self.runners:
            return self
        control = self.perturb or (self.train and self.train.flip)
        return replace(self, runners=tuple(runners), expect=self.expect if control else Expectation())

    def with_tp(self, tp: int) -> Case:
        self.check_tp(tp, self.tokens)
        return replace(self, tp=tp)

    def check_tp(self, tp: int, tokens: int, config: dict | None = None) -> None:
        """Raise CaseError when `tp` ranks cannot split this case at `tokens` (see `tp_problem`)."""
        problem = tp_problem(self.op_spec, self.shapes, tokens, self.config if config is None else config, tp)
        if problem:
            field_name, why, value = problem
            raise CaseError(f"{self.source}: case {self.name!r}: field {field_name!r}: {why} (got {value!r})")

    def input_specs(self):
        return self.op_spec.inputs(self.shapes, self.tokens, self.config)

    def output_specs(self):
        return self.op_spec.outputs(self.shapes, self.tokens, self.config)


# Registries parsed, by their files' paths and texts: the shipped cases' (every command's default, 185 cases: seconds
# to parse) kept apart, and the last few of other folders, oldest first (a test session goes back and forth between
# the shipped cases and dozens of its own folders; a sweep loads its registry once per cell).
_SHIPPED: dict[tuple, Registry] = {}
_LOADED: dict[tuple, Registry] = {}
_KEPT = 4
_KEEPING = threading.Lock()  # a night's cells load the registry from threads of their own


class Registry:
    """All cases of a folder of TOML files, by name (cases are frozen: one loaded registry can be shared)."""

    def __init__(self, cases: dict[str, Case]):
        self.cases = dict(sorted(cases.items()))

    @classmethod
    def load(cls, folder: Path = CASES_DIR) -> Registry:
        """The folder's cases; parsed again only when a case file's text changed (a sweep loads it once per cell)."""
        files = sorted(Path(folder).glob("*.toml"))
        if not files:
            raise CaseError(f"{folder}: no case files (*.toml) found")
        texts = []
        for path in files:
            try:
                texts.append((path, path.read_text()))
            except (OSError, UnicodeDecodeError) as error:
                raise CaseError(f"{path}: unreadable case file: {getattr(error, 'strerror', None) or error}") from None
        key = tuple((str(path.resolve()), text) for path, text in texts)
        kept = _SHIPPED if Path(folder).resolve() == CASES_DIR.resolve() else _LOADED
        with _KEEPING:
            registry = kept.pop(key) if key in kept else cls._parse(texts)
            kept[key] = registry  # the newest last
            while len(kept) > (1 if kept is _SHIPPED else _KEPT):
                del kept[next(iter(kept))]
        return registry

    @classmethod
    def _parse(cls, texts: list[tuple[Path, str]]) -> Registry:
        raw: dict[str, tuple[Path, dict]] = {}
        for path, text in texts:
            try:
                document = tomllib.loads(text)
            except tomllib.TOMLDecodeError as error:
                raise CaseError(f"{path}: malformed TOML: {error}") from None
            for name, table in document.items():
                if not isinstance(table, dict):
                    raise CaseError(f"{path}: top-level key {name!r} must be a case table (got {table!r})")
                try:
                    paths.check(name, "case")  # it names the case's checkpoint folder and run folders
                except paths.UnsafeName as error:
                    raise CaseError(f"{path}: {error}") from None
                if name == SHARED_WEIGHTS:
                    raise CaseError(f"{path}: case name {name!r} is taken: checkpoints/{SHARED_WEIGHTS}/ holds the "
                                    "weights that cases share")
                if name in raw:
                    raise CaseError(f"{path}: case {name!r} is already defined in {raw[name][0]}")
                raw[name] = (path, table)
        return cls({name: _build(name, path, _resolve_base(name, raw)) for name, (path, _) in raw.items()})

    def get(self, name: str) -> Case:
        if name in self.cases:
            return self.cases[name]
        close = difflib.get_close_matches(name, self.cases, n=5, cutoff=0.5)
        hint = f"; did you mean: {', '.join(close)}?" if close else f"; known cases: {', '.join(self.cases)}"
        raise CaseError(f"unknown case {name!r}{hint}")

    def for_device(self, device: str) -> list[Case]:
        return [case for case in self.cases.values() if device in case.devices]


def _resolve_base(name: str, raw: dict[str, tuple[Path, dict]], seen: tuple[str, ...] = ()) -> dict:
    path, table = raw[name]
    base = table.get("base")
    if base is None:
        return table
    if not isinstance(base, str) or base not in raw:
        raise CaseError(f"{path}: case {name!r}: field 'base': no such case (got {base!r})")
    if base in seen or base == name:
        raise CaseError(f"{path}: case {name!r}: field 'base': cycle through {' -> '.join((*seen, name, base))}")
    return _merge(_resolve_base(base, raw, (*seen, name)), {k: v for k, v in table.items() if k != "base"})


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in ("expect", "perturb"):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class _Fields:
    """Typed access to one case table; every failure names file, case, field and value."""

    def __init__(self, name: str, path: Path, table: dict):
        self.name, self.path, self.table = name, path, table

    def error(self, field_name: str, problem: str, value: Any) -> CaseError:
        return CaseError(f"{self.path}: case {self.name!r}: field {field_name!r}: {problem} (got {value!r})")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., where: dict | None = None,
            label: str | None = None):
        table = self.table if where is None else where
        label = label or key
        if key not in table:
            if default is ...:
                raise self.error(label, "is required", None)
            return default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.error(label, f"must be {' or '.join(k.__name__ for k in kinds)}", value)
        if not isinstance(value, kinds):
            raise self.error(label, f"must be {' or '.join(k.__name__ for k in kinds)}", value)
        return value

    def choice(self, key: str, choices, default: Any = ...):
        value = self.get(key, str, default)
        if value not in choices:
            raise self.error(key, f"must be one of {', '.join(map(str, choices))}", value)
        return value


def _build(name: str, path: Path, table: dict) -> Case:
    f = _Fields(name, path, table)
    unknown = sorted(set(table) - FIELDS)
    if unknown:
        raise f.error(unknown[0], f"unknown field; known fields: {', '.join(sorted(FIELDS))}", table[unknown[0]])
    op = f.choice("op", tuple(OPS))
    spec = OPS[op]
    dtype = f.choice("dtype", DTYPES)
    tp = f.get("tp", int, 1)
    if tp not in TP_SIZES:
        raise f.error("tp", f"must be one of {', '.join(map(str, TP_SIZES))}", tp)
    seed = f.get("seed", int)
    if seed < 0:
        raise f.error("seed", "must be >= 0", seed)
    tokens = f.get("tokens", int)
    if tokens <= 0:
        raise f.error("tokens", "must be > 0", tokens)

    shapes = f.get("shapes", dict, {} if not spec.shape_fields else ...)
    if set(shapes) != set(spec.shape_fields):
        raise f.error("shapes", f"op {op} needs exactly {', '.join(spec.shape_fields)}", shapes)
    for key, value in shapes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise f.error(f"shapes.{key}", "must be a positive integer", value)

    config = f.get("config", dict, {})
    for key, value in config.items():
        knob = KNOBS.get(key)
        if knob is None:
            raise f.error(f"config.{key}", f"unknown knob; known: {', '.join(KNOBS)}", value)
        f.get(key, knob.types, where=config, label=f"config.{key}")
        if knob.choices and value not in knob.choices:
            raise f.error(f"config.{key}", f"must be one of {', '.join(knob.choices)}", value)
    if ("model" in config) != ("model" in spec.knobs):
        readers = [name for name, other in OPS.items() if "model" in other.knobs]
        raise f.error("config.model", f"is required for op {op} and only for the ops that run a model "
                                      f"({', '.join(readers)})", config.get("model"))
    model = None
    if "model" in config:
        given = config["model"]
        try:
            model = families.family_of(given.get("family", families.DEFAULT)).config.resolve(given)
        except families.ModelConfigError as error:
            raise f.error("config.model", str(error), given) from None
        try:  # the interpreter its HF side needs: a bad name is refused here, before anything runs
            environments.of_family(model.record)
        except ValueError as error:
            raise f.error("config.model.family", str(error), model.family) from None
        config = {**config, "model": model.to_dict()}  # the wire form; the typed one is Case.model
    if "train" in table and "train" not in spec.tables:
        trainers = [name for name, other in OPS.items() if "train" in other.tables]
        raise f.error("train", f"is only for training ops ({', '.join(trainers)})", table["train"])
    if "train" in spec.tables:  # stored complete in the config, so the request carries it to every runner
        config = {**config, "train": train_table.parse(f, dtype, model, dict(train_state_names(model))).to_dict()}
    config = spec.resolve(config)

    _check_tensor_parallel(f, spec, shapes, tp, tokens, config)
    input_specs = spec.inputs(shapes, tokens, config)
    input_roles = {s.name: s.role for s in input_specs}
    tensors_table = f.get("tensors", dict, {})
    tensors = {}
    for input_spec in input_specs:
        tensor_name, role = input_spec.name, input_spec.role
        given = tensors_table.get(tensor_name, {})
        if not isinstance(given, dict):
            raise f.error(f"tensors.{tensor_name}", "must be a table like {dist = 'normal', std = 0.02}", given)
        if role == "labels":  # derived from the ids (harness.case.generate), no distribution of its own
            if tensor_name in tensors_table:
                raise f.error(f"tensors.{tensor_name}", "is derived from the ids (next token), not drawn", given)
            continue
        integer = role == "ids" or input_spec.dtype == "int64"  # token ids; an integer weight (a hash table)
        default = ({"dist": "randint", "high": input_spec.high} if integer
                   else input_spec.default_dist or DEFAULT_DISTRIBUTION[role])
        merged = {**default, **given}
        if (merged["dist"] == "randint") != integer or (
                integer and not 0 < _number(merged.get("high")) <= input_spec.high):
            raise f.error(f"tensors.{tensor_name}", f"integer tensors take dist = 'randint' with 0 < high <= "
                          f"{input_spec.high}; float tensors take normal or uniform", given)
        tensors[tensor_name] = _distribution(f, tensor_name, merged, given)
    for extra in set(tensors_table) - set(input_roles):
        raise f.error(f"tensors.{extra}", f"op {op} has no such input; inputs: {', '.join(input_roles)}",
                      tensors_table[extra])

    runners = tuple(f.get("runners", list, list(DEFAULT_RUNNERS)))
    if len(runners) != 2 or any(r not in RUNNERS for r in runners):
        raise f.error("runners", f"must be two of {', '.join(RUNNERS)} (the same one twice is allowed)", list(runners))
    devices = tuple(f.get("devices", list, list(DEVICES)))
    if not devices or any(d not in DEVICES for d in devices):
        raise f.error("devices", f"must be a non-empty list of {', '.join(DEVICES)}", list(devices))

    gpu_memory = f.get("gpu_memory_gib", (int, float), None)
    if gpu_memory is not None and (gpu_memory <= 0 or "gpu" not in devices):
        raise f.error("gpu_memory_gib", "must be > 0, on a case whose devices list gpu", gpu_memory)

    outputs = [s.name for s in spec.outputs(shapes, tokens, config)]
    tolerance = tolerance_policy.parse(f, outputs)
    return Case(
        name=name, source=path, description=f.get("description", str, ""), family=f.get("family", str, spec.family),
        op=op, dtype=dtype, tp=tp, seed=seed, tokens=tokens, shapes=dict(shapes), config=dict(config),
        tensors=tensors, runners=runners, devices=devices,
        # a float64 model case is judged by the semantic check (harness.compare.model_outputs), a tolerance of its own
        expect=_expectation(f, input_roles, spec.outputs(shapes, tokens, config),
                            tolerance is not None or (model is not None and dtype == "float64")),
        perturb=_perturbation(f, input_roles, {s.name: s.shape for s in input_specs},
                              {s.name: WIDTHS.get(resolve_dtype(s.dtype, dtype), 0) for s in input_specs}),
        weights_from=_weight_import(f, input_roles), tolerance=tolerance, truth=f.get("truth", bool, True),
        gpu_memory_gib=None if gpu_memory is None else float(gpu_memory),
    )


def tp_problem(spec: Op, shapes: dict, tokens: int, config: dict, tp: int) -> tuple[str, str, Any] | None:
    """(field, why, value) when `tp` ranks cannot split the op: the one divisibility check, in one wording, for
    case files, ``--tp``, ``--tokens`` and ``--versus-tp``."""
    if tp not in TP_SIZES:
        return "tp", f"must be one of {', '.join(map(str, TP_SIZES))}", tp
    if spec.tp_split_field is None:  # a whole model: one device
        return ("tp", f"op {spec.name} runs at tp=1 only", tp) if tp != 1 else None
    split = shapes[spec.tp_split_field]
    if split % tp:
        return f"shapes.{spec.tp_split_field}", f"must be divisible by tp={tp}", split
    if config.get("sequence_parallel", False):
        if tp == 1:
            return "config.sequence_parallel", "needs tp > 1 (Megatron refuses it without tensor parallelism)", True
        if tokens % tp:
            return "tokens", f"must be divisible by tp={tp} with sequence_parallel", tokens
    return None


def _check_tensor_parallel(f: _Fields, spec: Op, shapes: dict, tp: int, tokens: int, config: dict) -> None:
    problem = tp_problem(spec, shapes, tokens, config, tp)
    if problem:
        raise f.error(*problem)
    if tp > 1:
        names = [s.name for s in (*spec.inputs({k: 1 for k in spec.shape_fields}, 1, config),
                                  *spec.outputs({k: 1 for k in spec.shape_fields}, 1, config))]
        undeclared = [n for n in names if n not in spec.partition(config)]
        if undeclared:
            raise f.error("tp", f"op {spec.name} declares no partition dim for {', '.join(undeclared)}", tp)


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def _distribution(f: _Fields, tensor_name: str, merged: dict, given: dict) -> dict:
    dist = merged["dist"]
    if dist not in DISTRIBUTIONS:
        raise f.error(f"tensors.{tensor_name}.dist", f"must be one of {', '.join(DISTRIBUTIONS)}", dist)
    params = DISTRIBUTIONS[dist]
    for key in set(given) - params - {"dist"}:
        raise f.error(f"tensors.{tensor_name}.{key}", f"{dist} takes {', '.join(sorted(params))}", given[key])
    resolved = {"dist": dist}
    for key in sorted(params):
        value = merged.get(key, {"low": -1.0, "high": 1.0}.get(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise f.error(f"tensors.{tensor_name}.{key}", "must be a number", value)
        resolved[key] = float(value)
    if dist == "normal" and resolved["std"] <= 0:
        raise f.error(f"tensors.{tensor_name}.std", "must be > 0", resolved["std"])
    if dist == "uniform" and resolved["low"] >= resolved["high"]:
        raise f.error(f"tensors.{tensor_name}.low", "must be < high", resolved["low"])
    return resolved


def _expectation(f: _Fields, input_roles: dict, output_specs, has_tolerance: bool) -> Expectation:
    table = f.get("expect", dict, {})
    outputs = [s.name for s in output_specs]
    default = "WITHIN_TOLERANCE" if has_tolerance else "BITWISE_PASS"
    verdict = f.get("verdict", str, default, where=table, label="expect.verdict")
    if verdict not in VERDICTS:
        raise f.error("expect.verdict", f"must be one of {', '.join(VERDICTS)}", verdict)
    if verdict == "WITHIN_TOLERANCE" and not has_tolerance:
        raise f.error("expect.verdict", "needs a `tolerance` table saying what the case accepts", verdict)
    lists = {}
    for key in ("differs", "equal", "only_differ"):
        names = f.get(key, list, [], where=table, label=f"expect.{key}")
        for tensor_name in names:
            if tensor_name not in outputs:
                raise f.error(f"expect.{key}", f"no such output; {_some(outputs, tensor_name)}", tensor_name)
        lists[key] = tuple(names)
    steps = sorted({int(m.group(1)) for name in outputs if (m := STEP_PREFIX.match(name))})
    bitwise_steps = f.get("bitwise_steps", list, [], where=table, label="expect.bitwise_steps")
    for step in bitwise_steps:
        if isinstance(step, bool) or step not in steps:
            raise f.error("expect.bitwise_steps", f"must list training steps of the case ({_span(steps)})", step)
    if "only_differ" in table and not lists["only_differ"]:
        raise f.error("expect.only_differ", "names the tensors that differ: give at least one (all equal: "
                                            "verdict = \"BITWISE_PASS\")", [])
    clash = set(lists["equal"]) & set(lists["only_differ"]) or {
        name for name in lists["only_differ"] if (m := STEP_PREFIX.match(name)) and int(m.group(1)) in bitwise_steps}
    if clash:
        raise f.error("expect.only_differ", "names a tensor the expectation also says is equal", sorted(clash)[0])
    ranks_agree = f.get("ranks_agree", bool, True, where=table, label="expect.ranks_agree")
    for key in set(table) - set(EXPECT_FIELDS):
        raise f.error(f"expect.{key}", f"unknown field; known: {', '.join(EXPECT_FIELDS)}", table[key])
    return Expectation(verdict, lists["differs"], lists["equal"], lists["only_differ"] if "only_differ" in table
                       else None, tuple(bitwise_steps), ranks_agree, stated=bool(table))


EXPECT_FIELDS = ("verdict", "differs", "equal", "only_differ", "bitwise_steps", "ranks_agree")
STEP_PREFIX = re.compile(r"step(\d+)\.")  # a training case's outputs: step{k}.<quantity>...


def _span(steps: list[int]) -> str:
    return f"1..{steps[-1]}" if steps else "this case has no training steps"


def _perturbation(f: _Fields, input_roles: dict, input_shapes: dict, widths: dict) -> Perturbation | None:
    table = f.get("perturb", dict, None)
    if table is None:
        return None
    side = f.get("side", str, where=table, label="perturb.side")
    if side not in ("a", "b"):
        raise f.error("perturb.side", "must be 'a' or 'b'", side)
    tensor = f.get("tensor", str, where=table, label="perturb.tensor")
    if tensor not in input_roles or input_roles[tensor] in ("ids", "labels"):
        floats = [n for n, r in input_roles.items() if r not in ("ids", "labels")]
        raise f.error("perturb.tensor", f"no such floating-point input; inputs: {', '.join(floats)}", tensor)
    index = tuple(f.get("index", list, where=table, label="perturb.index"))
    shape = input_shapes[tensor]
    fits = len(index) == len(shape) and all(
        isinstance(i, int) and 0 <= i < n for i, n in zip(index, shape, strict=True))
    if not fits:
        raise f.error("perturb.index", f"must index into {tensor} of shape {list(shape)}", list(index))
    bit = f.get("bit", int, 0, where=table, label="perturb.bit")
    width = widths[tensor]  # the tensor's own format: an fp32 expert bias in a bf16 case has 32 bits
    if not 0 <= bit < width - 1:
        raise f.error("perturb.bit", f"must be a mantissa or exponent bit of {width}-bit floats, 0..{width - 2}", bit)
    return Perturbation(side, tensor, index, bit)


def _weight_import(f: _Fields, input_roles: dict) -> WeightImport | None:
    table = f.get("weights_from", dict, None)
    if table is None:
        return None
    file = f.get("file", str, None, where=table, label="weights_from.file")
    tensors = f.get("tensors", dict, where=table, label="weights_from.tensors")
    resolved = {}
    for canonical, names in tensors.items():
        if canonical not in input_roles or input_roles[canonical] != "weight":
            weights = [n for n, r in input_roles.items() if r == "weight"]
            raise f.error(f"weights_from.tensors.{canonical}", f"not a weight of this op; weights: {weights}", names)
        names = [names] if isinstance(names, str) else names
        if not names or not all(isinstance(n, str) for n in names):
            raise f.error(f"weights_from.tensors.{canonical}", "must be a tensor name or a list of them", names)
        resolved[canonical] = tuple(names)
    concat_dim = f.get("concat_dim", int, 0, where=table, label="weights_from.concat_dim")
    package = f.get("package", str, None, where=table, label="weights_from.package")
    if package is not None and file is None:
        raise f.error("weights_from.file", "is required with weights_from.package (a path inside the package)", None)
    return WeightImport(file, resolved, concat_dim, package)


def _some(names: list[str], wanted: str, shown: int = 8) -> str:
    """A few of `names` for an error message: the closest to `wanted` first, and how many there are (a model case has
    thousands of outputs)."""
    close = difflib.get_close_matches(wanted, names, n=shown, cutoff=0.5)
    listed = close or names[:shown]
    more = f" (of {len(names)} outputs)" if len(names) > len(listed) else ""
    return f"{'closest' if close else 'outputs'}: {', '.join(listed)}{more}"

