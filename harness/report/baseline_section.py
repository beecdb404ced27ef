"""The nightly report's "Known verdicts (baseline)" section, from the data `harness.baselines.records.judge` stored
in the night's report.json under ``baseline``: per platform the cases ran on, the baseline applied (or none, and
how to record one), then the cases whose judgement is news."""

from __future__ import annotations

from pathlib import Path

from harness.baselines import records
from harness.report import blocks as doc

TITLES = (("changed", "Changed against the baseline (fail)"),
          ("lost", "Ran in the baseline, UNSUPPORTED or not run tonight (fail)"),
          ("fixed", "Now meets its expectation, which the record did not (fail: look, then record it again)"),
          ("runner changed", "A runner changed since the record (judged by its own expectation)"),
          ("redefined", "Case definition changed since the record (judged by its own expectation)"),
          ("new", "No record of the case (judged by its own expectation)"),
          ("within tolerance", "Numbers moved within the case's stated tolerance"))
COUNTED = ("match", "changed", "lost", "fixed", "runner changed", "redefined", "new", "within tolerance", "not run")


def blocks(section: dict | None) -> list[tuple]:
    if not section:
        return []
    out: list[tuple] = [doc.h(2, "Known verdicts (baseline)")]
    by_platform: dict[str, list[dict]] = {}
    for case in section["cases"]:
        by_platform.setdefault(case["platform"], []).append(case)
    for part in section["platforms"]:
        out += _platform(part, by_platform.get(part["platform_id"], []), section.get("run_id"))
    for status, title in TITLES:
        cases = [c for c in section["cases"] if c["status"] == status]
        if cases:
            out += [doc.h(3, f"{title}: {len(cases)}"),
                    doc.ul([f"`{c['case']}` {c['baseline_verdict'] or '—'} → **{c['verdict'] or 'not run'}**"
                            + (f": {'; '.join(c['changes'])}" if c["changes"] else "") for c in cases])]
    return out


def _platform(part: dict, cases: list[dict], run_id: str | None) -> list[tuple]:
    where = describe(part["platform"])
    if part["file"]:
        recorded = part.get("recorded_from") or {}
        counts = ", ".join(f"{n} {s}" for s in COUNTED if (n := sum(c["status"] == s for c in cases)))
        out = [doc.p(f"{where}: against `{_short_path(part['file'])}` (recorded from `{recorded.get('run_id')}`, "
                     f"tokens {recorded.get('tokens') or 'each case own'}): {counts}.")]
        if part.get("not_in_night"):
            out.append(doc.p("In the baseline, not in this night: "
                             + ", ".join(f"`{n}`" for n in part["not_in_night"]) + "."))
        return out
    out = [doc.p(f"{where}: **no baseline for this platform** ({len(cases)} cases): each case is judged by its own "
                 "expectation, and a case that differs where it states none is listed apart, under \"Differs, no "
                 f"baseline\". If tonight's verdicts are this platform's and right, accept them: "
                 f"`python -m harness baseline update --from reports/{run_id or '<this run>'}` (writes "
                 f"`baselines/{part['suggested_file']}`; commit it).")]
    nearest = part.get("nearest")
    if nearest:
        out += [doc.p(f"Nearest baseline: `{_short_path(nearest['file'])}`; the platform fields that differ:"),
                doc.table(["field", "baseline", "tonight"],
                          [[f"`{d['field']}`", _code(d["baseline"]), _code(d["tonight"])]
                           for d in nearest["differences"]])]
    return out


def describe(platform: dict) -> str:
    """A platform in a few words: device, CPU model or GPU, and the vector-ISA level."""
    if platform.get("device") == "gpu":
        return f"gpu {platform.get('gpu') or '(unknown GPU)'}"
    return f"{platform.get('device')} {platform.get('cpu')} ({records.isa_level(platform.get('cpu_isa') or '')})"


def _short_path(file: str) -> str:
    """``baselines/<name>.json``: the folder and the file, not where the checkout lives."""
    path = Path(file)
    return f"{path.parent.name}/{path.name}"


def _code(value) -> str:
    return "(absent)" if value is None else f"`{value}`"


def line(section: dict | None) -> str:
    """One line for the terminal."""
    if not section:
        return "baselines: off"
    parts = []
    for part in section["platforms"]:
        cases = [c for c in section["cases"] if c["platform"] == part["platform_id"]]
        if part["file"]:
            counts = ", ".join(f"{n} {s}" for s in COUNTED if (n := sum(c["status"] == s for c in cases)))
            parts.append(f"baseline {part['file']}: {counts or 'no cases'}")
        else:
            parts.append(f"baseline: none for {describe(part['platform'])} ({len(cases)} cases judged by their own "
                         "expectations)")
    return "; ".join(parts) or "baseline: no cases"
