"""Capture APIs, one module per framework (``torch``, ``paddle``) with the same small interface: module outputs by
forward hooks and parameter gradients, written in the canonical names of docs/model-contract.md, around any training
step. Each imports only its own framework, safetensors and ``harness.families.names`` (standard library), so a runner
or a user's own training script can import it without the rest of the harness. See ``harness/capture/torch.py``."""

import math
from pathlib import Path

MODULES_DIR = "modules"  # a recorder's modules_at files beside its step files (harness.attach.modules)
MODULE_ORDER = "order"  # a module file's metadata entry: a model of its own's modules in the order its forward ran


def module_file(folder, step: int) -> Path:
    """Where a recorder writes step `step`'s module outputs (``modules_at``)."""
    return Path(folder) / MODULES_DIR / f"step{step:05d}.safetensors"


def micro_batch_key(micro_batch: int, name: str) -> str:
    """``mb{i}.<name>``: a module output of one micro-batch, `name` the capture's own (``module.<canonical>``)."""
    return f"mb{micro_batch}.{name}"


def module_sources(seen: dict[str, dict], rule, word: str = "module") -> tuple[list, str | None]:
    """The tensors a canonical module output is made of (its rule's sources, as hooks stored them in `seen`), or
    why it cannot be had: a source that did not run, or ran more than once in the step. Framework-free: both
    capture modules share it and only drop the batch dim and concatenate in their own framework."""
    what = "input" if rule.kind == "input_of" else "output"
    parts = []
    for source in rule.sources:
        stored = seen.get(source, {})
        if stored.get("_repeated"):
            return [], f"{word} {source!r} ran more than once in the step"
        if what not in stored:
            return [], f"{word} {source!r} did not run"
        parts.append(stored[what])
    return parts, None


# --- per-module re-feed (issue 12): side a records, side b replays ------------------------------------------------
# A request's config.refeed = {"mode": "record"} makes a model runner write, beside its outputs, each re-fed unit's
# input, output and output gradient in canonical layout (REFEED_FILE). {"mode": "replay", "from": <side a's file>}
# makes it run the same step with each unit's input and output replaced by side a's (forward) and each unit's output
# gradient replaced by side a's (backward): every canonical tensor it then writes is computed by side b's code from
# side a's tensors around it. The framework parts live in capture.torch / capture.paddle (``Refeed``).

# A unit counts as re-fed only when everything side b's run had to replace was replaced: each tensor argument (its
# input; Megatron's core attention: query, key and value), its output (not for `keep_output` units) and its output
# gradient. Otherwise it is "not re-fed", with why (side a recorded none, the shapes do not fit, it ran twice).

REFEED_FILE = "refeed.safetensors"
INPUT, OUTPUT, GRAD = "refeed.input.", "refeed.output.", "refeed.grad_output."
EXPERT_WHY = ("a routed expert's input is the tokens its side's router sent it (permuted, data-dependent): not "
              "mapped between sides; its tensors are attributed to the MoE block around it")


def input_key(unit: str, argument: str = "input") -> str:
    """Where a unit's input is kept: ``refeed.input.<unit>``, or for a unit taking several tensor arguments
    ``refeed.<argument>.<unit>`` (Megatron's core attention: ``refeed.query.``, ``refeed.key.``, ``refeed.value.``)."""
    return f"refeed.{argument}.{unit}"


def split_input_key(name: str) -> tuple[str, str] | None:
    """(argument, unit) of an input key (``input_key``), or None for any other name."""
    if not name.startswith("refeed.") or name.startswith((OUTPUT, GRAD)):
        return None
    argument, _, unit = name[len("refeed."):].partition(".")
    return (argument, unit) if unit else None


def refeed_units(modules: list[str], rule_of, extra: dict[str, list[str]] | None = None,
                 skip: dict[str, str] | None = None) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Re-fed units ({canonical module: framework module paths whose outputs make it, concatenated on the last dim})
    and {canonical module: why not re-fed}. A module captured as another module's input (``input_of``) is no unit:
    its value is recomputed by the code before that module. `skip`: {regex: why} for modules the runner excludes."""
    import re

    units, why_not = {}, {}
    for name in modules:
        reason = next((why for pattern, why in (skip or {}).items() if re.search(pattern, name)), None)
        rule = rule_of(name)
        if rule.kind == "not_captured":
            why_not[name] = rule.why
        elif reason:
            why_not[name] = reason
        elif rule.kind in ("same", "output_of", "tokens_of", "cat_last"):
            units[name] = list(rule.sources)
    units.update(extra or {})
    return units, why_not


def main_input(args: tuple, kwargs: dict | None):
    """Where a module call's main tensor is: ("arg", 0), ("kw", "hidden_states") or None."""
    if args:
        return ("arg", 0)
    if kwargs and "hidden_states" in kwargs:
        return ("kw", "hidden_states")
    return None


def part_of(value, index: int, parts: int):
    """Part `index` of `parts` equal parts on the last dim (a cat_last unit: HF's gate_proj and up_proj), or None."""
    if parts == 1:
        return value
    width = value.shape[-1]
    if width % parts:
        return None
    step = width // parts
    return value[..., index * step:(index + 1) * step]


class RefeedBook:
    """What a re-feed run keeps, framework-free: side a's tensors (`a`), what it writes (`tensors`, and `parts` of
    cat_last units by index), what each unit had to have replaced (`needed`) and what was (`replaced`), what could
    not be and why, and how often each hooked module ran. ``capture.torch.Refeed`` and ``capture.paddle.Refeed`` add
    the hooks and the tensor operations. `arguments`: {unit: names of its positional tensor arguments} for a unit
    taking more than one (default: its one input, "input")."""

    def __init__(self, mode: str, batch_dim: int, keep_output, a: dict, arguments: dict | None = None):
        self.mode, self.batch_dim, self.keep_output, self.a = mode, batch_dim, set(keep_output), a
        self.arguments = {unit: tuple(names) for unit, names in (arguments or {}).items()}
        self.keys = (INPUT, OUTPUT, GRAD)
        self.tensors: dict = {}
        self.parts: dict[str, dict[int, object]] = {}
        self.units: list[str] = []  # the units hooked
        self.needed: dict[str, list[str]] = {}  # unit -> what side b's run had to replace (replay)
        self.replaced: dict[str, list[str]] = {}  # unit -> what was replaced ("input", "output", "output gradient")
        self.unfit: dict[str, dict[str, str]] = {}  # unit -> {what: why it was not replaced}
        self.not_refed: dict[str, str] = {}
        self.calls: dict[tuple[str, int], int] = {}
        self._handles: list = []

    def hook_units(self, units: dict[str, list[str]], named: dict, word: str, hook) -> None:
        """`hook(unit, index, parts, module)` for every module of every unit the model has; the rest not re-fed."""
        for unit, paths in units.items():
            missing = [p for p in paths if p not in named]
            if missing:
                self.not_refed[unit] = f"the model has no {word} {missing[0]!r}"
                continue
            self.units.append(unit)
            for i, path in enumerate(paths):
                hook(unit, i, len(paths), named[path])

    def arguments_of(self, unit: str) -> tuple[str, ...]:
        return self.arguments.get(unit, ("input",))

    def need(self, unit: str, what: str) -> None:
        """Side b's run met something of `unit` to replace (a floating-point input, its output, its gradient)."""
        needed = self.needed.setdefault(unit, [])
        if what not in needed:
            needed.append(what)

    def first_call(self, unit: str, index: int, word: str) -> bool:
        """Count a call; a module that runs twice in the step has no one input to replace."""
        count = self.calls[(unit, index)] = self.calls.get((unit, index), 0) + 1
        if count > 1:
            self.not_refed[unit] = f"the {word} ran more than once in the step"
        return count == 1

    def fitted(self, key: str, unit: str, index: int, parts: int, local, what: str):
        """Side a's part for this module (`key`: its full name in side a's file), if side a recorded it and it has as
        many elements and the same dtype as the local tensor; else None, with why."""
        self.need(unit, what)
        value = self.a.get(key)
        if value is None:
            self.unfit.setdefault(unit, {})[what] = f"side a recorded no {what} for it"
            return None
        value = part_of(value, index, parts)
        if value is None or math.prod(value.shape) != math.prod(local.shape) or value.dtype != local.dtype:
            self.unfit.setdefault(unit, {})[what] = (
                f"side a's {what} ({None if value is None else list(value.shape)}, "
                f"{None if value is None else value.dtype}) does not fit side b's ({list(local.shape)}, {local.dtype})")
            return None
        return value

    def note(self, unit: str, what: str) -> None:
        self.replaced.setdefault(unit, [])
        if what not in self.replaced[unit]:
            self.replaced[unit].append(what)

    def joined(self, concat_last) -> dict:
        """Remove the hooks; the written tensors, each cat_last unit's parts joined by `concat_last`. In a replay, a
        unit that did not get everything it had replaced becomes not re-fed, saying what and why."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for key, parts in self.parts.items():
            ordered = [parts[i] for i in sorted(parts)]
            self.tensors[key] = ordered[0] if len(ordered) == 1 else concat_last(ordered)
        if self.mode == "replay":
            for unit in self.units:
                why = self._not_all_replaced(unit)
                if why:
                    self.not_refed.setdefault(unit, why)
        return dict(self.tensors)

    def _not_all_replaced(self, unit: str) -> str | None:
        if not any(count for (name, _), count in self.calls.items() if name == unit):
            return "it did not run in the step"
        replaced = self.replaced.get(unit, [])
        missing = [what for what in self.needed.get(unit, []) if what not in replaced]
        if replaced and not missing:
            return None
        whys = self.unfit.get(unit, {})
        said = "; ".join(f"{what}: {whys.get(what, 'not replaced')}" for what in missing) or "nothing to replace"
        return f"{'nothing' if not replaced else 'not all'} of it was replaced ({said})"

    def meta(self) -> dict:
        meta = {"mode": self.mode, "replaced": self.replaced, "not_refed": self.not_refed}
        if self.arguments:
            meta["arguments"] = {unit: list(names) for unit, names in self.arguments.items()}
        return meta
