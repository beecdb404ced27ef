"""The nightly report for people (report.md, report.html): news first, then every case, then provenance."""

from __future__ import annotations

from pathlib import Path

from harness import resources
from harness.baselines import records, trend
from harness.report import baseline_section
from harness.report import blocks as doc

OUTCOME_MARK = {"pass": "✅ pass", "fail": "❌ FAIL", "skip": "⏭️ skip"}


def blocks(night: dict) -> list[tuple]:
    s = night["summary"]
    tokens = f"tokens {night['tokens']} (override)" if night["tokens"] else "each case's own tokens"
    out: list[tuple] = [
        ("h", 1, f"Bitwise nightly on {night['device']}: {s['failed']} failed, {s['passed']} passed, "
                 f"{s['skipped']} skipped"),
        ("p", f"Run `{night['run_id']}`, {night['started_at']} to {night['finished_at']}, {tokens}, "
              f"harness {night['harness']['version']} on {night['harness']['host'].get('cpu')}; "
              f"exit code {night['exit_code']}." + (f" Failed: {failed_by(night)}." if s.get("failed_by") else "")),
    ]
    if night.get("select"):
        out.append(("p", f"Only the cases `-k {night['select']}` picks: the baseline's other cases are listed "
                         "under it, not judged."))
    if night.get("shard"):
        out.append(("p", f"Shard {night['shard']['index']} of {night['shard']['count']}: not judged alone (exit code "
                         "0); `python -m harness nightly-merge` judges it with the other shards."))
    out += _kept(night["cases"])
    out += trend.blocks(night["trend"])
    out += baseline_section.blocks(night.get("baseline"))
    out += [("h", 2, "Cases"),
            ("table", ["case", "outcome", "verdict", "expected", "paddle level", "differing tensors", "max ULP",
                       "wall s", "why"],
             [_row(c) for c in night["cases"]])]
    for kind, title in records.FAILURE_KINDS.items():
        failures = [c for c in night["cases"] if c.get("failure") == kind]
        if not failures:
            continue
        out.append(("h", 2, f"Failures: {title} ({len(failures)})"))
        if kind == "unknown":
            out.append(("p", "These cases differ, and nothing says they may: the case states no expectation and no "
                             "baseline record of its platform applies (none for the platform, no record of the "
                             "case, or a record of another definition or runner). If the differences are the "
                             "platform's and right, accept them: `python -m harness baseline update --from "
                             f"reports/{night['run_id']}`, and commit the file it writes."))
        for c in failures:
            out += [("h", 3, f"`{c['case']}`: {c['verdict']}"),
                    ("ul", [c["message"], *c["problems"], f"report: `{c['report']}`"])]
            tail = _stderr_tail(c)
            if tail:
                out.append(("pre", tail))
    prov = trend.provenance(night)
    if prov:
        out += [("h", 2, "Provenance"),
                ("table", ["runner and field", "value"], [[f"`{k}`", f"`{v}`"] for k, v in prov.items()])]
    return out


def _kept(cases: list[dict]) -> list[tuple]:
    """What the night deleted of its cases' tensor files (harness.commands.nightly_keep), or nothing (``--keep``)."""
    pruned = [c["kept"] for c in cases if c.get("kept")]
    if not pruned:
        return []
    deleted = sum(k["deleted_bytes"] for k in pruned)
    kept = [k for k in pruned if k["kept_files"]]
    return [("p", f"Tensor files: kept of the failed cases ({len(kept)}: "
                  f"{resources.human_bytes(sum(k['kept_bytes'] for k in kept))}), deleted of the others once "
                  f"judged ({resources.human_bytes(deleted)}); each case's report names the command that makes "
                  "them again (`--keep` keeps them all).")]


def failed_by(night: dict) -> str:
    """``1 ERROR, 3 differs, no baseline``: the failed cases by why they failed."""
    return ", ".join(f"{n} {records.FAILURE_KINDS[kind]}" for kind, n in night["summary"].get("failed_by", {}).items())


def summary_lines(night: dict, run_dir: Path) -> list[str]:
    """What the terminal says after the night's line: why cases failed, how to accept differences nothing states,
    and how the baselines were applied."""
    lines = [f"failed: {failed_by(night)}"] if night["summary"].get("failed_by") else []
    if night["summary"].get("failed_by", {}).get("unknown"):
        lines.append(f"accept the differences no baseline states (if right): python -m harness baseline update "
                     f"--from {run_dir}")
    if night.get("shard"):
        lines.append("shard: not judged alone; nightly-merge judges the shards together")
    elif "baseline" in night:
        lines.append(baseline_section.line(night["baseline"]))
    return lines


def write(night: dict, run_dir: Path) -> None:
    document = blocks(night)
    (run_dir / "report.md").write_text(doc.markdown(document))
    (run_dir / "report.html").write_text(doc.html(document, _title(night), base=run_dir))


def markdown(night: dict) -> str:
    return doc.markdown(blocks(night))


def html(night: dict) -> str:
    return doc.html(blocks(night), _title(night))


def _title(night: dict) -> str:
    return f"Bitwise nightly {night['run_id']}"


def _row(c: dict) -> list[str]:
    tensors = (c.get("result") or {}).get("tensors", [])
    differing = [t for t in tensors if t["status"] != "EQUAL"]
    names = ", ".join(f"`{t['name']}` ({t['mismatches']})" for t in differing)
    max_ulp = max((t["max_ulp"] for t in tensors), default=None)
    why = "; ".join(c["problems"]) if c["outcome"] == "fail" and c["problems"] else c["message"]
    return [f"`{c['case']}`", OUTCOME_MARK[c["outcome"]], c["verdict"] or "—", c["expected"] or "—",
            paddle_level(c.get("result")), names or "—", "—" if max_ulp is None else str(max_ulp),
            f"{c['wall_seconds']:.1f}", _short(why)]


def paddle_level(result: dict | None) -> str:
    """Which Paddle implementation level the case's Paddle side ran (PaddleFleet, PaddleFormers, recipe), or "—"."""
    levels = []
    for side in (result or {}).get("sides", []):
        meta = side.get("meta") or {}
        if side.get("runner") == "paddle" and side.get("label") in ("a", "b"):
            level = meta.get("paddle_level") or ("pinned " + meta["unsupported"].split("'")[1]
                                                 if "config.paddle_impl" in meta.get("unsupported", "") else None)
            if level and level not in levels:
                levels.append(level)
    return ", ".join(levels) or "—"


def _stderr_tail(c: dict) -> str:
    sides = (c.get("result") or {}).get("sides", [])
    return "\n".join(f"[{s['label']} {s['runner']}] {s['stderr_tail'][-800:]}" for s in sides
                     if s["status"] == "error" and s["stderr_tail"])


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
