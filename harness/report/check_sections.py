"""Report sections for the checks around the comparison: distance from the truth oracle, the case's
tolerance policy, and determinism across ``--repeat`` runs. Read from ``CaseResult.to_dict()`` only."""

from __future__ import annotations

from harness.case.tolerance import LIMITS
from harness.report.blocks import h, p, table, ul


def versus_oracle(data: dict, figures: dict) -> list[tuple]:
    oracle = data.get("versus_oracle") or {}
    if not oracle:
        return []
    out = [h(2, "Distance from the truth oracle")]
    if oracle["status"] != "ok":
        return out + [p(f"No oracle result ({oracle['status']}): {oracle['reason']}")]
    rows = []
    side_rows = {label: _rows(data, side["tensors"]) for label, side in oracle["sides"].items()}
    closer_of = _family_closer(oracle["closer"]) if data.get("model") else oracle["closer"]
    names = [t["name"] for tensors in side_rows.values() for t in tensors]
    for name in dict.fromkeys(names):
        for label, side in oracle["sides"].items():
            t = next(t for t in side_rows[label] if t["name"] == name)
            closer = closer_of.get(name, "")
            rows.append([name, f"{label} ({side['runner']})", t["mismatches"], f"{t['mismatch_share']:.4%}",
                         t["max_ulp"], _histogram(t["ulp_histogram"]), f"{t['max_abs_error']:.3g}",
                         f"{t['max_error_in_scale_ulps']:.3g}", "closer" if label == closer else ""])
    truth = oracle.get("truth") or ("the exact result (float64 accumulation from the same input bits, rounded once; "
                                    "see `harness/runners/oracle/runner.py`)")
    return out + [
        p(f"Each side against {truth}. Closer: fewer differing elements, then the smaller max abs error."),
        table(["tensor", "side", "mismatches", "share", "max ULP", "ULP histogram", "max abs err",
               "max err in ULPs at scale", "closer"], rows, "llrrrlrrl")]


def _rows(data: dict, tensors: list[dict]) -> list[dict]:
    from harness.compare.model_outputs import group_rows
    return group_rows(tensors) if data.get("model") else tensors


def _family_closer(closer: dict) -> dict:
    """Per expert family (one folded row), the side closer on more of its members."""
    from harness.compare.model_outputs import family
    votes: dict[str, dict[str, int]] = {}
    for name, label in closer.items():
        key = family(name)
        if key is not None:
            votes.setdefault(key, {}).setdefault(label, 0)
            votes[key][label] += 1
    folded = {k: v for k, v in closer.items() if family(k) is None}
    for key, count in votes.items():
        folded[f"{key} ({sum(count.values())} tensors)"] = max(count, key=count.get)
    return folded


def tolerance(data: dict, figures: dict) -> list[tuple]:
    policy = data.get("tolerance") or {}
    if not policy:
        return []
    rows = []
    for t in policy["tensors"]:
        if not t["checks"]:
            rows.append([t["name"], t["status"], "(none: must be bitwise)", "", "", _yes(t["within"])])
        for check in t["checks"]:
            rows.append([t["name"], t["status"], f"{check['limit']} <= {check['value']:g}",
                         f"{check['measured']:.6g}", f"{check['margin']:.6g}", _yes(check["met"])])
    out = [h(2, f"Tolerance policy: {'met' if policy['within'] else 'NOT met'}"),
           p(f"Policy: {_policy_text(policy['policy'], legend=True)}. Margin = limit - measured (negative: exceeded)."),
           table(["tensor", "status", "limit", "measured", "margin", "within"], rows, "lllrrl")]
    problems = [f"`{t['name']}`: {'; '.join(t['problems'])}" for t in policy["tensors"] if t["problems"]]
    return out + ([ul(problems)] if problems else [])


def determinism(data: dict, figures: dict) -> list[tuple]:
    repeats = data.get("repeats") or {}
    if not repeats:
        return []
    rows = []
    for label, side in repeats["sides"].items():
        runs = ", ".join([f"{label} ({side.get('first_process', 'fresh process')})"]
                         + [f"{r['label']} {r['status']} ({r.get('process', 'fresh process')})"
                            for r in side["repeats"]])
        rows.append([label, side["runner"], _yes(side["consistent"]), runs, ", ".join(_differing(side)) or "none"])
    out = [h(2, f"Determinism: {repeats['runs']} runs per side, each against its first"),
           table(["side", "runner", "self-consistent", "runs", "differing tensors"], rows)]
    for side in repeats["sides"].values():
        for repeat in side["repeats"]:
            if not repeat["differing"]:
                continue
            tensor_rows = []
            for t in repeat["tensors"]:
                first = t["first_mismatch"]
                where = f"{first['index']}: {first['a_bits']} vs {first['b_bits']}" if first else ""
                tensor_rows.append([t["name"], t["status"], t["mismatches"], f"{t['mismatch_share']:.4%}",
                                    t["max_ulp"], _histogram(t["ulp_histogram"]), where])
            out += [h(3, f"{repeat['label']} ({repeat.get('process', 'fresh process')}) against its first run"),
                    table(["tensor", "status", "mismatches", "share", "max ULP", "ULP histogram", "first mismatch"],
                          tensor_rows, "llrrrll")]
    return out


def console_lines(data: dict) -> list[str]:
    """One line per tensor: who is closer to the oracle; one per unstable side; the tolerance outcome."""
    lines = []
    oracle = data.get("versus_oracle") or {}
    if oracle.get("status") == "ok" and data.get("model"):  # hundreds of tensors: counts only
        for label, side in oracle["sides"].items():
            equal = sum(1 for t in side["tensors"] if t["status"] == "EQUAL")
            lines.append(f"side {label} ({side['runner']}) vs the float64 truth: {equal} of {len(side['tensors'])} "
                         "tensors equal to the truth rounded once")
        votes = list(oracle["closer"].values())
        lines.append("closer to the truth: " + ", ".join(f"{v} on {votes.count(v)}" for v in sorted(set(votes))))
    elif oracle.get("status") == "ok":
        for label, side in oracle["sides"].items():
            counts = ", ".join(f"{t['name']} {t['mismatches']} (max {t['max_ulp']} ULP)" for t in side["tensors"])
            lines.append(f"side {label} ({side['runner']}) vs oracle, differing elements: {counts}")
        if oracle["closer"]:
            lines.append("closer to the oracle: " + ", ".join(f"{k} {v}" for k, v in oracle["closer"].items()))
    elif oracle:
        lines.append(f"oracle {oracle['status']}: {oracle['reason']}")
    for label, side in (data.get("repeats") or {}).get("sides", {}).items():
        differing = _differing(side)
        state = "self-consistent" if side["consistent"] else f"NOT self-consistent ({', '.join(differing)})"
        lines.append(f"side {label} ({side['runner']}) over {data['repeats']['runs']} runs: {state}")
    policy = data.get("tolerance") or {}
    if policy:
        lines.append(f"tolerance: {'met' if policy['within'] else 'NOT met'} ({_policy_text(policy['policy'])})")
    return lines


def _differing(side: dict) -> list[str]:
    return sorted({n for r in side["repeats"] for n in r["differing"]})


def _policy_text(policy: dict, legend: bool = False) -> str:
    def limits(table):
        return ", ".join(f"{k} <= {v:g}" for k, v in table.items())

    parts = [f"all tensors: {limits(policy['limits'])}"] if policy["limits"] else ["other tensors: bitwise"]
    parts += [f"`{name}`: {limits(table)}" for name, table in policy["tensors"].items()]
    meanings = f" ({'; '.join(f'{k}: {v[2]}' for k, v in LIMITS.items())})" if legend else ""
    return "; ".join(parts) + meanings


def _histogram(histogram: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in histogram.items()) or "-"


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"
