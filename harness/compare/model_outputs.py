"""The model level on the comparing side: pairing a model's outputs, the float64 truth, the float64 semantic check,
and the summary the report opens with. Returns data only; harness/report renders it.

- ``compare_outputs``: a model's outputs in the op record's topological order (forward, then backward). A routed
  expert's output exists only where the expert got tokens, and a side may be unable to observe a module (its
  ``meta.json`` lists it under ``not_captured``): such a tensor is not compared, and the summary says why. One side
  having an expert output that the other, capturing experts too, does not have is a DIFF (routing differs).
- ``versus_truth``: each side against the float64 run of ``hf_model`` (float64 mode: nothing in float32 inside),
  rounded once to each tensor's dtype (``harness.runners.oracle.round_once``); the same table as the linear ops'
  truth oracle (``versus_oracle``), which is what the report shows.
- ``semantic_check``: for a float64 case, the largest relative error at the tensor's scale (max abs error / the
  largest magnitude of side b) per tensor against ``FLOAT64_AGREEMENT`` (or the higher floor a framework states for
  a tensor in the name map's ``[<fw>.float64]``); integer tensors must be equal. The first tensor beyond it, in
  topological order, is a mapping error, not a numeric difference.
- ``summarise``: "k of 794 canonical gradients BITWISE_PASS", the same for module outputs, the first divergence as a
  module path, and ``group_rows`` to fold the per-expert tensors into one row per expert family.
"""

from __future__ import annotations

import re

import numpy as np

from harness.case.registry import Case
from harness.case.specs import resolve_dtype
from harness.compare.dumps import Dump, compare_dumps
from harness.compare.tensors import DIFF, EQUAL, TensorComparison, compare_tensor
from harness.compare.versus_oracle import closer_side
from harness.families.names import NameMap, lookup
from harness.run.orchestrate import SideResult
from harness.runners.oracle.runner import round_once

FLOAT64_AGREEMENT = 1e-10  # relative error at scale every pair must reach in float64 (docs/model-contract.md)
FRAMEWORK_OF = {"hf_model": "hf", "megatron_model": "megatron", "paddle_model": "paddle"}
TRUTH_LABEL = "oracle"  # the truth side takes the oracle's place (label, report table)
TRUTH_RUNNER = "hf_model"
_EXPERT = re.compile(r"\.experts\.\d+(?=\.|$)")


def compare_outputs(case: Case, sides: list[SideResult]) -> tuple[list[TensorComparison], dict, dict]:
    """Comparisons in topological order, the comparator's memory, and {name: why} for tensors not compared."""
    files = [set(load_keys(side.outputs)) for side in sides]
    both, alone, skipped = [], {}, {}
    for spec in case.output_specs():
        present = [spec.name in f for f in files]
        if all(present) or not spec.optional:
            both.append(spec.name)
        elif not any(present):
            whys = [(side, _not_captured(side, spec.name)) for side in sides]
            blind = {why: [f"{side.label} ({side.runner})" for side, w in whys if w == why]
                     for _, why in whys if why is not None}
            skipped[spec.name] = ("; ".join(f"not captured by side {' and '.join(who)}: {why}"
                                            for why, who in blind.items())
                                  or "written by neither side: the expert got no tokens")
        else:
            writer, other = (sides[0], sides[1]) if present[0] else (sides[1], sides[0])
            why = _not_captured(other, spec.name)
            if why is not None:
                skipped[spec.name] = f"side {other.label} ({other.runner}) does not capture it: {why}"
            else:
                alone[spec.name] = (f"only side {writer.label} ({writer.runner}) wrote it: the expert got tokens on "
                                    "that side only (routing differs)")
    a, b = (Dump(side.outputs, dict.fromkeys(both, side.outputs)) for side in sides)
    compared, memory = compare_dumps(a, b)
    by_name = {t.name: t for t in compared}
    by_name.update({name: TensorComparison(name, DIFF, note=note) for name, note in alone.items()})
    order = [s.name for s in case.output_specs() if s.name in by_name]
    return [by_name[name] for name in order], memory, skipped


def _not_captured(side: SideResult, name: str) -> str | None:
    """Why `side` did not capture output `name` (its meta.json `not_captured`, keyed by the output name, a pattern
    of it, or the module path without "module."), None when it says nothing."""
    table = side.meta.get("not_captured", {})
    return lookup(table, name) or lookup(table, name.removeprefix("module."))


def load_keys(path) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as handle:
        return list(handle.keys())


def versus_truth(case: Case, pair: list[SideResult], truth: SideResult | None) -> dict:
    """Each side against the float64 truth rounded once to the tensor's dtype; versus_oracle's structure."""
    if truth is None:
        return {}
    if truth.status != "ok":
        return {"status": truth.status, "reason": truth.reason, "sides": {}, "closer": {}}
    from safetensors import safe_open
    sides = {}
    with safe_open(str(truth.outputs), framework="numpy") as exact:  # one tensor at a time: a _full model is large
        truth_names = set(exact.keys())
        for side in pair:
            if side.status != "ok":
                continue
            comparisons = []
            with safe_open(str(side.outputs), framework="numpy") as outputs:
                names = set(outputs.keys())
                for spec in case.output_specs():
                    if spec.name not in names or spec.name not in truth_names:
                        continue
                    value = exact.get_tensor(spec.name)
                    if value.dtype.kind == "f":
                        dtype = np.dtype(_numpy_dtype(resolve_dtype(spec.dtype, case.dtype)))
                        value = round_once(value.astype(np.float64), dtype)
                    comparisons.append(compare_tensor(spec.name, outputs.get_tensor(spec.name), value))
            sides[side.label] = {"runner": side.runner, "tensors": [c.to_dict() for c in comparisons]}
    common = _common_names(sides)
    for side in sides.values():
        side["tensors"] = [t for t in side["tensors"] if t["name"] in common]
    return {"status": "ok", "reason": "", "truth": f"{TRUTH_RUNNER} in float64 (float64 mode), rounded once to each "
            f"tensor's dtype", "sides": sides, "closer": closer_side(sides)}


def _common_names(sides: dict) -> set[str]:
    names = [{t["name"] for t in side["tensors"]} for side in sides.values()]
    return set.intersection(*names) if names else set()


def _numpy_dtype(name: str):
    import ml_dtypes
    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32, "float64": np.float64}[name]


def semantic_check(case: Case, tensors: list[TensorComparison], runners: tuple[str, str],
                   agreement: float = FLOAT64_AGREEMENT, table: str = "float64") -> dict:
    """float64 agreement per tensor; `ok` False names the first tensor beyond its limit (a mapping error). `table`:
    the name maps' table of floors that applies (harness.families.names.FLOORS)."""
    family = case.model.family
    maps = []
    for runner in runners:
        try:
            maps.append(NameMap.load(family, FRAMEWORK_OF[runner]))
        except (KeyError, ValueError):
            maps.append(None)
    rows, first = [], None
    for t in tensors:
        limit = max([agreement] + [m.float64_floor(t.name, agreement, table) for m in maps if m])
        if t.status == EQUAL or (t.status == DIFF and t.elements and not t.dtype.startswith("int") and
                                 t.max_abs_error == 0 and not t.nan_mismatches and not t.nan_payload_diffs):
            relative = 0.0  # equal, or only +0 against -0 (numerically equal)
        elif t.status != DIFF or t.dtype.startswith("int") or not t.elements:
            relative = float("inf")
        else:
            relative = t.max_abs_error / t.scale if t.scale else float("inf")
        ok = relative <= limit
        rows.append({"name": t.name, "relative_error": relative, "limit": limit, "ok": ok})
        if not ok and first is None:
            first = t.name
    worst = max((r["relative_error"] for r in rows), default=0.0)
    return {"agreement": agreement, "ok": first is None, "first_mismatch": first,
            "first_module": module_path(first) if first else None, "max_relative_error": worst,
            "tensors_beyond": [r for r in rows if not r["ok"]][:20], "checked": len(rows),
            "floors": {r["name"]: r["limit"] for r in rows if r["limit"] > agreement}}


def module_path(name: str) -> str:
    """The module a canonical output belongs to: module.X -> X, grad.X.weight -> X (its parameter's module)."""
    if name.startswith("module."):
        return name[len("module."):]
    if name.startswith("grad."):
        return re.sub(r"\.(weight|bias)$", "", name[len("grad."):])
    return {"logits": "lm_head", "loss": "loss"}.get(name, name)


def idle_experts(case: Case, sides: list[SideResult]) -> dict[str, list[int]]:
    """Per MoE layer, the routed experts no token went to on either side (their gradients are zero on both)."""
    from safetensors import safe_open
    idle = {}
    experts = case.model.record.routed_experts(case.model)
    for spec in case.output_specs():
        if not spec.name.endswith(".mlp.gate.topk_indices"):
            continue
        used: set[int] = set()
        for side in sides:
            with safe_open(str(side.outputs), framework="numpy") as handle:
                if spec.name in handle.keys():
                    used |= {int(e) for e in np.unique(handle.get_tensor(spec.name))}
        layer = spec.name[len("module."):-len(".mlp.gate.topk_indices")]
        idle[layer] = [e for e in range(experts) if e not in used]
    return idle


def summarise(case: Case, tensors: list[TensorComparison], skipped: dict, idle: dict | None = None) -> dict:
    specs = case.output_specs()
    grads = [s.name for s in specs if s.name.startswith("grad.")]
    status = {t.name: t.status for t in tensors}
    grads_equal = sum(1 for n in grads if status.get(n) == EQUAL)
    modules = [t for t in tensors if t.name.startswith("module.")]
    modules_equal = sum(1 for t in modules if t.status == EQUAL)
    first = next((t.name for t in tensors if t.status != EQUAL), None)
    first_grad = next((t.name for t in tensors if t.status != EQUAL and t.name.startswith("grad.")), None)
    idle_names = {f"grad.{layer}.mlp.experts.{e}.{w}.weight" for layer, es in (idle or {}).items() for e in es
                  for w in ("gate_up_proj", "down_proj")}
    return {
        "gradients": {"total": len(grads), "bitwise_pass": grads_equal, "compared": sum(n in status for n in grads),
                      "bitwise_pass_of_idle_experts": sum(1 for n in idle_names if status.get(n) == EQUAL)},
        "idle_experts": {layer: len(es) for layer, es in (idle or {}).items()},
        "module_outputs": {"compared": len(modules), "bitwise_pass": modules_equal, "not_compared": len(skipped)},
        "logits": status.get("logits"), "loss": status.get("loss"),
        "first_divergence": first, "first_divergence_module": module_path(first) if first else None,
        "first_gradient_divergence": first_grad,
        "not_compared": _group_skipped(skipped),
    }


def _group_skipped(skipped: dict) -> dict[str, str]:
    grouped: dict[str, tuple[int, str]] = {}
    for name, why in skipped.items():
        key = _EXPERT.sub(".experts.*", name)
        count, _ = grouped.get(key, (0, why))
        grouped[key] = (count + 1, why)
    return {f"{key} ({count})" if count > 1 else key: why for key, (count, why) in grouped.items()}


def family(name: str) -> str | None:
    """The expert family of a per-expert tensor name (experts.N -> experts.*), None for other tensors."""
    key = _EXPERT.sub(".experts.*", name)
    return key if key != name else None


def group_rows(rows: list[dict]) -> list[dict]:
    """Tensor rows (TensorComparison.to_dict()) with each expert family folded into one row, where its first member
    stood: counts and sums over the members, maxima of the per-tensor maxima."""
    out, groups = [], {}
    for row in rows:
        key = family(row["name"])
        if key is None:
            out.append(row)
            continue
        if key not in groups:
            groups[key] = []
            out.append({"_group": key})
        groups[key].append(row)
    return [_fold(item["_group"], groups[item["_group"]]) if "_group" in item else item for item in out]


def _fold(key: str, members: list[dict]) -> dict:
    differing = [m for m in members if m["status"] != EQUAL]
    elements = sum(m["elements"] for m in members)
    mismatches = sum(m["mismatches"] for m in members)
    histogram: dict[str, int] = {}
    for m in members:
        for bucket, count in m["ulp_histogram"].items():
            histogram[bucket] = histogram.get(bucket, 0) + count
    first = differing[0] if differing else None
    return {
        "name": f"{key} ({len(members)} tensors)", "status": EQUAL if not differing else
        f"DIFF {len(differing)}/{len(members)}", "dtype": members[0]["dtype"], "shape": "per expert",
        "elements": elements, "mismatches": mismatches, "mismatch_share": mismatches / elements if elements else 0.0,
        "max_ulp": max(m["max_ulp"] for m in members), "p99_ulp": max(m["p99_ulp"] for m in members),
        "sign_flips": sum(m["sign_flips"] for m in members), "ulp_histogram": histogram,
        "max_abs_error": max(m["max_abs_error"] for m in members),
        "max_rel_error": max(m["max_rel_error"] for m in members),
        "max_error_in_scale_ulps": max(m["max_error_in_scale_ulps"] for m in members),
        "signed_zero_diffs": sum(m["signed_zero_diffs"] for m in members),
        "nan_payload_diffs": sum(m["nan_payload_diffs"] for m in members),
        "nan_mismatches": sum(m["nan_mismatches"] for m in members),
        "first_mismatch": _first_member_mismatch(first),
        "members_differing": [m["name"] for m in differing][:50],
    }


def _first_member_mismatch(first: dict | None) -> dict | None:
    if first is None:
        return None
    expert = first["name"].rsplit("experts.", 1)[1].split(".")[0]
    inner = first["first_mismatch"] or {}
    return {"index": f"expert {expert} {inner.get('index', '')}".rstrip(), "a_bits": inner.get("a_bits", ""),
            "b_bits": inner.get("b_bits", "")}
