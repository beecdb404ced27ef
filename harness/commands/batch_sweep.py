"""``compare CASE --versus batch=1..64``: one runner's rows (a model's sequence) alone against the same rows inside
batches of M other rows (sequences), one ordinary run per M (``harness.levels.op`` and ``.model``,
``harness.case.batch``), and a table of M by tensors.

Each cell is a full comparison with its own report in its own folder inside this one; this folder's ``report.json``
and ``report.md`` say, per tensor, the batch sizes over which the rows' bits hold, and the first M and first tensor
whose bits depend on the batch, with the cell's ULP figures and each side's distance from the truth. A row whose bits
change with M is that cell's DIFF: the summary is DIFF (exit 1) naming the M, never a pass.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from harness import pipeline
from harness.commands.sweep import exit_code
from harness.compare.result import CaseResult
from harness.pipeline import run_folder
from harness.report import blocks as doc
from harness.report.blocks import h, table, ul
from harness.report.sweep_report import matrix_cell
from harness.run import supervisor, workers

BATCH_SCHEMA = 1


def run(name: str, others: Sequence[int], runner: str | None,
        options: pipeline.CompareOptions = pipeline.DEFAULT_OPTIONS) -> tuple[dict, Path]:
    """One run per count of other rows; the summary report and its folder."""
    batch_id, batch_dir = run_folder.new_run_dir(Path(options.reports_dir), f"batch-{name}")
    started, cells = run_folder.now(), []
    with workers.fresh_processes(options.fresh_process), workers.serving(batch_dir / "workers"):
        for count in others:
            if supervisor.interrupted():
                break
            versus = pipeline.Versus("batch", count, runner)
            result, run_dir = pipeline.compare_case(name, replace(options, versus=versus, reports_dir=batch_dir))
            cells.append(cell(result, run_dir, count))
            print(f"[{len(cells)}/{len(others)}] {name} M={count}: {result.verdict}", file=sys.stderr, flush=True)
    report = {"schema": BATCH_SCHEMA, "kind": "batch", "batch_id": batch_id, "case": name, "device": options.device,
              "runner": next((c["runner"] for c in cells if c["runner"]), runner), "others": list(others),
              "unit": next((c["unit"] for c in cells if c["runner"]), "row"),
              "tensors": list(dict.fromkeys(t for c in cells for t in c["tensors"])),
              "verdicts": dict(Counter(c["verdict"] for c in cells)), "exit_code": exit_code(cells),
              "argv": sys.argv, "started_at": started, "finished_at": run_folder.now(), "cells": cells}
    report["summary"] = summary(report)
    (batch_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (batch_dir / "report.md").write_text(doc.markdown(blocks(report)))
    return report, batch_dir


def cell(result: CaseResult, run_dir: Path, others: int) -> dict:
    """What the summary keeps of one M's run: verdict, tensors, the first divergence, distances from the truth."""
    truth = {side["runner"] + f" ({label})": {t["name"]: t["mismatches"] for t in side["tensors"]}
             for label, side in (result.versus_oracle or {}).get("sides", {}).items()}
    return {"others": others, "runner": (result.comparison or {}).get("runner"), "verdict": result.verdict,
            "unit": (result.comparison or {}).get("unit", "row"),
            "exit_code": result.exit_code, "message": result.message, "run_dir": run_dir.name,
            "first_divergence": result.first_divergence, "truth_mismatches": truth,
            "tensors": {t.name: t.to_dict() for t in result.tensors}}


def summary(report: dict) -> dict:
    """Per tensor, the M over which its bits hold and the first M where they do not; the first M whose run differs
    and its first diverging tensor."""
    compared = [c for c in report["cells"] if c["tensors"]]
    holds = {name: [c["others"] for c in compared if c["tensors"].get(name, {}).get("status") == "EQUAL"]
             for name in report["tensors"]}
    first_diff = next((c for c in compared if any(t["status"] != "EQUAL" for t in c["tensors"].values())), None)
    return {"holds": holds,
            "first_differs": {name: next((c["others"] for c in compared
                                          if c["tensors"].get(name, {}).get("status") != "EQUAL"), None)
                              for name in report["tensors"]},
            "first_m": first_diff["others"] if first_diff else None,
            "first_tensor": first_diff["first_divergence"] if first_diff else None,
            "invariant": all(c["verdict"] == "BITWISE_PASS" for c in report["cells"]) and bool(report["cells"])}


def headline(report: dict) -> str:
    s, runner = report["summary"], report["runner"]
    whose, one = ("the sequence's", "the sequence's") if report.get("unit") == "sequence" else ("the rows'", "a row's")
    if s["invariant"]:
        return (f"{runner} on {report['case']}: {whose} bits hold inside every batch tried "
                f"(M = {', '.join(map(str, report['others']))})")
    if s["first_m"] is None:
        return (f"{runner} on {report['case']}: no M moved {one} bits, but not every run compared "
                f"({', '.join(f'{v} {n}' for v, n in report['verdicts'].items())}); see each run")
    first = next(c for c in report["cells"] if c["others"] == s["first_m"])
    tensor = first["tensors"].get(s["first_tensor"] or "", {})
    figures = f" ({tensor['mismatches']} elements, max {tensor['max_ulp']} ULP)" if tensor.get("mismatches") else ""
    return (f"{runner} on {report['case']}: {whose} bits depend on the batch from M={s['first_m']}: first "
            f"{s['first_tensor']}{figures}")


SIDES = {"row": "side a: the case's rows alone; side b: the same rows first in a batch with M other random rows, their "
                "upstream gradients zero (a padded token's)",
         "sequence": "side a: the case's sequence alone; side b: the same sequence first in a batch with M other "
                     "random sequences whose labels are all ignored (loss weight zero): the same loss and the same "
                     "parameter-gradient sums, the other sequences adding exact zeros; module outputs and logits "
                     "are the first sequence's"}
COLUMNS = 12  # past this many tensors (a model's), the table shows only those that moved at some M


def blocks(report: dict) -> list[tuple]:
    counts = ", ".join(f"{verdict} {n}" for verdict, n in sorted(report["verdicts"].items()))
    first_differs = report["summary"]["first_differs"]
    shown = report["tensors"] if len(report["tensors"]) <= COLUMNS else \
        [t for t in report["tensors"] if first_differs[t] is not None]
    rest = len(report["tensors"]) - len(shown)
    rows = [[c["others"], c["verdict"], *(matrix_cell(c["tensors"].get(t)) for t in shown),
             *([sum(c["tensors"].get(t, {}).get("status") == "EQUAL" for t in report["tensors"] if t not in shown)]
               if rest else []), f"`{c['run_dir']}`"] for c in report["cells"]]
    holds = [f"`{name}`: bits hold at M = {', '.join(map(str, ms)) or 'none'}"
             + (f"; first differs at M = {first_differs[name]}" if first_differs[name] is not None else "")
             for name, ms in report["summary"]["holds"].items() if name in shown]
    holds += [f"{rest} other tensors: bits hold at every M"] if rest else []
    notes = [f"M={c['others']}: {c['verdict']}: {c['message']}" for c in report["cells"]
             if c["verdict"] in ("ERROR", "UNSUPPORTED")]
    return [h(1, f"Batch invariance: {report['case']} on {report['device']}"),
            ul([headline(report), f"command: `{' '.join(report['argv'])}`",
                f"runs: {len(report['cells'])} ({counts}); exit code {report['exit_code']}",
                SIDES[report.get("unit", "row")] + "; each run's full report, with the truth, is `<run>/report.md`"]),
            table(["M", "verdict", *shown, *([f"{rest} others equal"] if rest else []), "run"], rows,
                  "rl" + "r" * (len(shown) + bool(rest)) + "l"),
            ul(holds + notes)]


def console(report: dict, batch_dir: Path, out: Console | None = None) -> None:
    out = out or Console(width=None if Console().is_terminal else 160)
    out.print(headline(report))
    many = len(report["tensors"]) > COLUMNS
    for name, ms in report["summary"]["holds"].items():
        if not many or report["summary"]["first_differs"][name] is not None:
            out.print(f"  {name}: bits hold at M = {', '.join(map(str, ms)) or 'none'}")
    out.print(f"batch report: {batch_dir / 'report.md'}  (exit code {report['exit_code']})")
