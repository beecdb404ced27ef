"""Per-module re-feed at the model level (``compare --refeed`` on a model case): did module M make a difference, or
was it handed one?

Two more runner processes: side a once more in record mode (each re-fed unit's input, output and output gradient,
canonical layout, ``harness.capture.REFEED_FILE``), then side b in replay mode: the same model, weights (side b's
checkpoint: a planted difference stays) and batch, each unit's input and output replaced by side a's in the forward
and each unit's output gradient replaced by side a's in the backward (``harness.capture.torch/paddle.Refeed``). Every
canonical tensor side b then writes is computed by side b's code from side a's tensors around it, so comparing it
with side a's says whether the code that makes it differs (made by) or not (carried in, when the full run differs).
A tensor belongs to the innermost re-fed unit holding it (a parameter's gradient: its module; a routed expert: the
MoE block). Rows ``refeed.input.<unit>`` compare the input side b's own code built for a unit from side a's
tensors: a difference there is made by the code between re-fed modules (a residual add, RoPE, an activation).
Megatron's core attention takes query, key and value (rows ``refeed.query.``, ``refeed.key.``, ``refeed.value.``):
all three are replaced, so a RoPE difference shows in the query and key rows, not as core attention's.
A unit counts as re-fed only when side b's run replaced all it had (its inputs, output, output gradient): one with
anything missing (side a recorded none of it, shapes that do not fit) is listed as not re-fed with why, and a
tensor of it, with no re-fed unit around it, is "not re-fed" too, never "made by" it.

Not attributed yet: the local gradient arriving at each unit's output before side a's replaces it (the replay run
writes it as ``refeed.grad_output.<unit>``). Measured on hf_model against itself (kimi_k2_2layer_fp32, 16 tokens):
it differs at the residual junctions (o_proj, a layer's output, the embedding) although the code is the same on
both sides, so it would name a false first local divergence. Probable cause (not proven): at a junction an RMSNorm
uses its input twice and the residual once; the replay's substitute node sums the norm's two contributions first,
while the plain run may sum the three in another order (floating-point addition is not associative). Parameter
gradients are unaffected: each is computed from side a's replaced output gradient (hf_model and paddle_model against
themselves: all equal).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.capture import GRAD, REFEED_FILE, input_key, split_input_key
from harness.case import checkpoints
from harness.case.registry import Case
from harness.compare.model_outputs import module_path
from harness.compare.refeed import attribution
from harness.compare.tensors import compare_tensor
from harness.run import orchestrate
from harness.run.orchestrate import SideSpec

LOSS_UNIT = "the loss"


def run(case: Case, pair: list[SideSpec], full: list, device: str, run_dir: Path, pythons: dict[str, str],
        timeout: float) -> dict:
    spec_a, spec_b = pair
    folder = run_dir / "refeed"
    folder.mkdir(parents=True, exist_ok=True)
    record = _side(case, {"mode": "record"}, spec_a, "record", folder, device, pythons, timeout)
    report = {"kind": "model", "runner": spec_b.runner, "fed_from": f"side a ({spec_a.runner})",
              "sides": {"record": _status(record)}}
    if record.status != "ok":
        return {**report, "error": f"side a's record run ({spec_a.runner}): {record.status}: {record.reason}"}
    replay = _side(case, {"mode": "replay", "from": str((record.folder / REFEED_FILE).resolve())}, spec_b, "replay",
                   folder, device, pythons, timeout)
    report["sides"]["replay"] = _status(replay)
    if replay.status != "ok":
        return {**report, "error": f"side b's replay run ({spec_b.runner}): {replay.status}: {replay.reason}"}
    a = {**checkpoints.load_tensors(record.outputs), **checkpoints.load_tensors(record.folder / REFEED_FILE)}
    b = {**checkpoints.load_tensors(replay.outputs), **checkpoints.load_tensors(replay.folder / REFEED_FILE)}
    meta = replay.meta.get("refeed", {})
    return {**report, **attribute(case, {t.name: t for t in full}, a, b, meta)}


def _side(case, request: dict, spec: SideSpec, mode: str, folder: Path, device, pythons, timeout):
    side_case = replace(case, config={**case.config, "refeed": request})
    side = SideSpec(spec.label, spec.runner, spec.inputs, spec.tp, f"{spec.label}-{mode}-{spec.runner}", spec.dtype,
                    environment=spec.environment)  # side b of --versus environment is re-fed in its environment
    return orchestrate.run_sides(side_case, [side], device, folder, pythons, timeout)[0]


def _status(side) -> dict:
    return {"runner": side.runner, "status": side.status, "reason": side.reason, "folder": str(side.folder),
            "wall_seconds": side.wall_seconds, "stderr_tail": side.stderr_tail[-2000:] if side.status != "ok" else ""}


def attribute(case: Case, full: dict, a: dict, b: dict, meta: dict) -> dict:
    """Per tensor, in topological order (a unit's input rows before its output): its unit and attribution. A unit is
    re-fed only if side b's run says it replaced something of it and named it in no "not re-fed" reason; a tensor
    of a unit that is not, with no re-fed unit around it, is "not re-fed: why"."""
    not_refed = dict(meta.get("not_refed", {}))
    replaced = meta.get("replaced", {})
    for unit in meta.get("units", []):
        if unit not in not_refed and not replaced.get(unit):
            not_refed[unit] = "side b's run replaced nothing of it"
    units = [u for u in meta.get("units", []) if u not in not_refed]
    rows, tensors = [], {}
    for name in _order(case, units, meta.get("arguments", {})):
        unit = owner(name, units)
        feeding = split_input_key(name)
        if feeding:
            argument, fed = feeding
            what = fed if argument == "input" else f"{fed} ({argument})"
            where = f"the code feeding {what} (inside {unit or 'the model'})"
        elif name.startswith(GRAD):
            where = f"the backward of the code using {name[len(GRAD):]}'s output"
        else:
            where = unit or module_path(name)
        if name == "loss":
            where = LOSS_UNIT
        if name not in a and name not in b:
            continue  # written by neither run (an expert no token went to, a tensor neither side captures)
        own = None if unit or feeding or name == "loss" else _why_not_refed(name, not_refed)
        if name not in a or name not in b or own:
            why = own or _why_not_refed(name, not_refed) or f"written only by side {'a' if name in a else 'b'}'s run"
            rows.append({"name": name, "unit": where, "full": _status_of(full.get(name)), "local": None,
                         "attribution": f"not re-fed: {why}"})
            continue
        local = compare_tensor(name, a[name], b[name])
        how = attribution(full.get(name), local, where)
        rows.append({"name": name, "unit": where, "full": _status_of(full.get(name)), "local": local.status,
                     "mismatches": local.mismatches, "max_ulp": local.max_ulp, "attribution": how})
        tensors[name] = how
    made = [r for r in rows if r["attribution"].startswith("made")]
    first = made[0] if made else None
    return {"rows": rows, "tensors": tensors, "first_local_divergence": first["name"] if first else None,
            "first_local_unit": first["unit"] if first else None, "units": units, "not_refed": not_refed,
            "replaced": meta.get("replaced", {}),
            # the case's tensors apart from the module inputs the replay fed (rows of their own, not outputs)
            "counts": _counts([r for r in rows if split_input_key(r["name"]) is None]),
            "input_counts": _counts([r for r in rows if split_input_key(r["name"]) is not None])}


def _counts(rows: list[dict]) -> dict[str, int]:
    return {k: sum(1 for r in rows if r["attribution"].startswith(k)) for k in ("made", "carried", "equal",
                                                                                "not re-fed")}


def _status_of(t) -> str | None:
    return None if t is None else t.status


def _why_not_refed(name: str, not_refed: dict) -> str | None:
    """Why the unit holding `name` is not re-fed (None: no such unit)."""
    path = module_path(name)
    for unit, why in not_refed.items():
        if path == unit or path.startswith(unit + ".") or _pattern_match(unit, path):
            return why
    return None


def _pattern_match(pattern: str, path: str) -> bool:
    import re
    if "{" not in pattern:
        return False
    text = re.escape(pattern).replace(r"\{L\}", r"\d+").replace(r"\{E\}", r"\d+")
    return re.fullmatch(text, path) is not None


def owner(name: str, units: list[str]) -> str | None:
    """The innermost re-fed unit holding a canonical tensor: its module, else the closest unit above it."""
    feeding = split_input_key(name)
    path = feeding[1] if feeding else name[len(GRAD):] if name.startswith(GRAD) else module_path(name)
    if name == "logits":
        path = "lm_head"
    if feeding:  # the code feeding a unit sits in the unit above it
        path = path.rsplit(".", 1)[0] if "." in path else ""
    best = None
    for unit in units:
        if (path == unit or path.startswith(unit + ".")) and (best is None or len(unit) > len(best)):
            best = unit
    return best


def _order(case: Case, units: list[str], arguments: dict[str, list[str]]) -> list[str]:
    """Forward (each unit's input rows before its output: its one input, or each tensor argument it takes), then
    backward: units in reverse, each one's output gradient row before the parameter gradients it holds."""
    names = [spec.name for spec in case.output_specs()]
    out = []
    for name in (n for n in names if not n.startswith("grad.")):
        unit = "lm_head" if name == "logits" else name[len("module."):] if name.startswith("module.") else None
        if unit in units:
            out += [input_key(unit, argument) for argument in arguments.get(unit, ["input"])]
        out.append(name)
    grads = [n for n in names if n.startswith("grad.")]
    held = {}
    for name in grads:
        held.setdefault(owner(name, units), []).append(name)
    for unit in reversed(units):  # (no GRAD + unit rows: see the module docstring)
        out += held.pop(unit, [])
    return out + [n for rest in held.values() for n in rest]

