"""The nightly report's "Known verdicts (baseline)" section, from the data `harness.compare.baseline.judge` stored
in the night's report.json under ``baseline``."""

from __future__ import annotations

from pathlib import Path

from harness.report import blocks as doc

TITLES = (("changed", "Changed against the baseline (fail)"), ("fixed", "Fixed (now meets its expectation)"),
          ("new", "New (no baseline record: not failed)"),
          ("expected", "Meets its expectation; numbers moved since the baseline"))


def blocks(section: dict | None) -> list[tuple]:
    if not section:
        return []
    out: list[tuple] = [doc.h(2, "Known verdicts (baseline)")]
    if section["status"] == "none":
        run = section.get("run_id") or "<this run>"
        out.append(doc.p(f"No baseline for this platform (fingerprint `{section['fingerprint_id']}`) in "
                         f"`{section['directory']}`: every case is judged by its own expectation. Record one with "
                         f"`python -m harness baseline update --from reports/{run}` (it would be "
                         f"`{section['suggested_file']}`)."))
        nearest = section.get("nearest")
        if nearest:
            out += [doc.p(f"Nearest baseline: `{_short_path(nearest['file'])}`; the fingerprint fields that differ:"),
                    doc.table(["field", "baseline", "tonight"],
                     [[f"`{d['field']}`", _code(d["baseline"]), _code(d["tonight"])] for d in nearest["differences"]])]
        return out
    counts = section["counts"]
    recorded = section.get("recorded_from") or {}
    tokens = recorded.get("tokens") or "each case's own"
    out.append(doc.p(f"Against `{_short_path(section['file'])}` (recorded from `{recorded.get('run_id')}`, tokens "
                     f"{tokens}): " + ", ".join(
                         f"{counts[s]} {s}" for s in ("match", "changed", "fixed", "new", "expected", "not run")
                         if counts.get(s)) + "."))
    for status, title in TITLES:
        cases = [c for c in section["cases"] if c["status"] == status]
        if cases:
            out += [doc.h(3, f"{title}: {len(cases)}"),
                    doc.ul([f"`{c['case']}` {c['baseline_verdict'] or '—'} → **{c['verdict']}**"
                            + (f": {'; '.join(c['changes'])}" if c["changes"] else "") for c in cases])]
    if section.get("not_in_night"):
        out.append(doc.p("In the baseline, not in this night: " + ", ".join(f"`{n}`" for n in section["not_in_night"])
                    + "."))
    return out


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
    if section["status"] == "none":
        return (f"baseline: none for this platform (fingerprint {section['fingerprint_id']}); cases judged by their "
                f"own expectations")
    counts = ", ".join(f"{n} {s}" for s, n in section["counts"].items() if n)
    return f"baseline {section['file']}: {counts or 'no cases'}"
