"""What changed between two nightly reports, so a reader sees the news first and what may explain it.

Both arguments are nightly ``report.json`` documents (see ``harness.nightly``). The result is plain data
(stored in the new report) plus ``blocks`` to render it. Provenance is flattened per runner so that a new
framework version, BLAS build, driver or CPU ISA shows up next to the failures it may have caused.
"""

from __future__ import annotations

import json

# Meta fields that change every run or name the request itself; never news.
VOLATILE_META = {"case", "op", "phases", "executable", "unsupported", "runner", "device"}
CASE_FIELDS = ("op", "dtype", "tp", "tokens", "shapes", "config", "runners", "expect", "perturb")


def compare(previous: dict | None, current: dict) -> dict:
    if previous is None:
        return {"previous": None}
    # Compare as stored: a night still in memory holds tuples where its report.json will hold lists.
    previous, current = (json.loads(json.dumps(night, default=str)) for night in (previous, current))
    before, after = _by_case(previous), _by_case(current)
    common = [name for name in after if name in before]
    new_failures, fixes, other = [], [], []
    for name in common:
        old, new = before[name], after[name]
        change = {"case": name, "before": _state(old), "after": _state(new), "message": new.get("message", "")}
        if new["outcome"] == "fail" and old["outcome"] != "fail":
            new_failures.append(change)
        elif old["outcome"] == "fail" and new["outcome"] == "pass":
            fixes.append(change)
        elif change["before"] != change["after"]:
            other.append(change)
    return {
        "previous": previous.get("run_id"),
        "new_failures": new_failures,
        "fixes": fixes,
        "other_changes": other,
        "metric_changes": [row for name in common for row in _metric_changes(name, before[name], after[name])],
        "case_changes": [row for name in common for row in _case_changes(name, before[name], after[name])],
        "new_cases": [{"case": name, "state": _state(after[name])} for name in after if name not in before],
        "removed_cases": [{"case": name, "state": _state(before[name])} for name in before if name not in after],
        "provenance_changes": _dict_changes(provenance(previous), provenance(current)),
    }


def provenance(night: dict) -> dict[str, str]:
    """Flat ``"<runner> <field>" -> value`` over every runner's meta.json in the night (first value wins)."""
    flat: dict[str, str] = {}
    for entry in night.get("cases", []):
        for side in (entry.get("result") or {}).get("sides", []):
            meta = {k: v for k, v in (side.get("meta") or {}).items() if k not in VOLATILE_META}
            for key, value in _flatten(meta):
                flat.setdefault(f"{side['runner']} {key}", value)
    return dict(sorted(flat.items()))


def changed(trend: dict) -> bool:
    return any(trend.get(key) for key in trend if key != "previous")


def blocks(trend: dict) -> list[tuple]:
    """The trend section as document blocks (plain tuples: see ``harness.report.blocks``)."""
    if trend.get("previous") is None:
        return [("h", 2, "What changed"),
                ("p", "No previous nightly report to compare with: this night is the baseline.")]
    out: list[tuple] = [("h", 2, f"What changed since `{trend['previous']}`")]
    if not changed(trend):
        return out + [("p", "Nothing: the same cases with the same outcomes, mismatch counts and max ULP, "
                            "and the same provenance.")]
    for key, title in (("new_failures", "New failures"), ("fixes", "Fixes"), ("other_changes", "Other changes")):
        if trend[key]:
            out += [("h", 3, f"{title} ({len(trend[key])})"),
                    ("ul", [f"`{c['case']}`: {c['before']} → **{c['after']}**"
                            + (f" — {c['message']}" if c["message"] else "") for c in trend[key]])]
    if trend["metric_changes"]:
        out += [("h", 3, "Mismatch changes"),
                ("table", ["case", "tensor", "status", "mismatches", "max ULP"],
                 [[f"`{m['case']}`", f"`{m['tensor']}`", _arrow(m["status"]), _arrow(m["mismatches"]),
                   _arrow(m["max_ulp"])] for m in trend["metric_changes"]])]
    for key, title in (("new_cases", "New cases"), ("removed_cases", "Removed cases")):
        if trend[key]:
            out += [("h", 3, f"{title} ({len(trend[key])})"),
                    ("ul", [f"`{c['case']}`: {c['state']}" for c in trend[key]])]
    if trend["case_changes"]:
        out += [("h", 3, "Case definition changes"),
                ("ul", [f"`{c['case']}` {c['field']}: `{c['before']}` → `{c['after']}`"
                        for c in trend["case_changes"]])]
    if trend["provenance_changes"]:
        out += [("h", 3, "Provenance changes (may explain the above)"),
                ("table", ["runner and field", "before", "after"],
                 [[f"`{p['field']}`", _code(p["before"]), _code(p["after"])] for p in trend["provenance_changes"]])]
    return out


def _by_case(night: dict) -> dict[str, dict]:
    return {entry["case"]: entry for entry in night.get("cases", [])}


def _state(entry: dict) -> str:
    verdict = entry.get("verdict")
    return f"{entry['outcome'].upper()} ({verdict})" if verdict else entry["outcome"].upper()


def _tensors(entry: dict) -> dict[str, dict]:
    return {t["name"]: t for t in (entry.get("result") or {}).get("tensors", [])}


def _metric_changes(name: str, old: dict, new: dict) -> list[dict]:
    before, after = _tensors(old), _tensors(new)
    rows = []
    for tensor in list(after) + [t for t in before if t not in after]:
        pair = [before.get(tensor, {}), after.get(tensor, {})]
        row = {"case": name, "tensor": tensor,
               **{key: [side.get(key) for side in pair] for key in ("status", "mismatches", "max_ulp")}}
        if any(row[key][0] != row[key][1] for key in ("status", "mismatches", "max_ulp")):
            rows.append(row)
    return rows


def _case_changes(name: str, old: dict, new: dict) -> list[dict]:
    before, after = ((entry.get("result") or {}).get("case") or {} for entry in (old, new))
    if not before or not after:
        return []
    return [{"case": name, "field": key, "before": before.get(key), "after": after.get(key)}
            for key in CASE_FIELDS if before.get(key) != after.get(key)]


def _dict_changes(before: dict, after: dict) -> list[dict]:
    keys = sorted(set(before) | set(after))
    return [{"field": k, "before": before.get(k), "after": after.get(k)} for k in keys if before.get(k) != after.get(k)]


def _flatten(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        yield prefix, " ".join(map(str, value))
    else:
        yield prefix, value


def _arrow(pair: list) -> str:
    before, after = ("—" if v is None else str(v) for v in pair)
    return before if before == after else f"{before} → {after}"


def _code(value) -> str:
    return "(absent)" if value is None else f"`{value}`"
