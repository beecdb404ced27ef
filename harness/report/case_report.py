"""Renderers over one ``CaseResult``: report.json (machine), report.md and report.html (people), pictures
of differing tensors, a rich console table."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.compare import model as model_level
from harness.compare import refeed
from harness.compare.result import CaseResult
from harness.report import html as report_html
from harness.report import pictures
from harness.report import sections as report_sections

VERDICT_STYLE = {"BITWISE_PASS": "bold green", "DIFF": "bold red", "UNSUPPORTED": "bold yellow", "ERROR": "bold red",
                 "WITHIN_TOLERANCE": "bold green", "NONDETERMINISTIC": "bold magenta"}


MODEL_PICTURES = 6  # a model case: pictures of its first differing tensors only (hundreds can differ)


def write(result: CaseResult, run_dir: Path) -> None:
    tensors = result.tensors
    if result.model:
        tensors = [t for t in tensors if t.mismatch_map is not None][:MODEL_PICTURES]
    figures = pictures.render(tensors, run_dir / "pictures")
    (run_dir / "report.json").write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    (run_dir / "report.md").write_text(markdown(result, figures))
    report_html.write(result, run_dir, figures)


def markdown(result: CaseResult, figures: dict[str, dict[str, str]] | None = None) -> str:
    data = result.to_dict()
    lines = [f"# {result.case_name}: {result.verdict}", "",
             f"- run: `{result.run_id}` on `{result.device}`, {result.started_at} to {result.finished_at}",
             f"- verdict: **{result.verdict}** (exit code {result.exit_code}): {result.message}"]
    if result.first_divergence:
        lines.append(f"- first divergence (outputs in topological order): `{result.first_divergence}`")
    lines += _model_lines(data)
    expectation = data["expectation"]
    if expectation.get("stated"):
        met = "met" if expectation["met"] else "NOT met: " + "; ".join(expectation["problems"])
        lines.append(f"- expected: {expectation['verdict']}; {met}")
    lines += _tensor_parallel_lines(data)
    case = data["case"]
    if case:
        lines.append(f"- runners: a = `{case['runners'][0]}` vs b = `{case['runners'][1]}`")
        lines.append(f"- case: `{case['op']}` {case['dtype']} tp={case['tp']} tokens={case['tokens']} "
                     f"shapes={case['shapes']} config={case['config']} (from `{case['source']}`)")
    if data["harness"].get("inputs"):
        lines.append(f"- inputs: `{data['harness']['inputs']}`")
    if data["checkpoint"]:
        lines.append(f"- checkpoint: `{data['checkpoint']['folder']}`")
        if data["checkpoint"].get("perturbed"):
            p = data["checkpoint"]["perturbed"]
            lines.append(f"- negative control: side {p['side']} reads `{p['tensor']}` with bit {p['bit']} of "
                         f"element {p['index']} flipped")
    if result.sides:
        lines += ["", "## Runners", "",
                  "| side | runner | status | implementation | oneDNN kernels run | versions | wall s |",
                  "|---|---|---|---|---|---|---|"]
        for side in data["sides"]:
            meta = side["meta"]
            versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
            status = side["status"] + (f": {side['reason']}" if side["reason"] else "")
            implementation = _cell(meta.get("implementation", ""))
            kernels = "<br>".join(meta.get("onednn_kernels", [])) or "none"
            lines.append(f"| {side['label']} | {side['runner']} | {_cell(status)} | {implementation} "
                         f"| {_cell(kernels)} | {_cell(versions)} | {side['wall_seconds']} |")
    if result.tensors:
        lines += ["", "## Tensors (side a against side b)", "",
                  "| tensor | status | dtype | shape | mismatches | share | max ULP | p99 ULP | sign flips | "
                  "max abs err | max rel err | max err in ULPs at scale | ±0 diffs | NaN diffs | first mismatch |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for t in model_level.group_rows(data["tensors"]) if data.get("model") else data["tensors"]:
            first = t["first_mismatch"]
            where = f"{first['index']}: {first['a_bits']} vs {first['b_bits']}" if first else ""
            lines.append(
                f"| {t['name']} | {t['status']} | {t['dtype']} | {t['shape']} | {t['mismatches']} | "
                f"{t['mismatch_share']:.4%} | {t['max_ulp']} | {t['p99_ulp']} | {t['sign_flips']} | "
                f"{t['max_abs_error']:.3g} | {t['max_rel_error']:.3g} | {t['max_error_in_scale_ulps']:.3g} | "
                f"{t['signed_zero_diffs']} | {t['nan_payload_diffs'] + t['nan_mismatches']} | {where} |")
        histograms = [(t["name"], t["ulp_histogram"]) for t in data["tensors"] if t["ulp_histogram"]]
        if histograms:
            lines += ["", "### ULP distance histograms (mismatching elements)", ""]
            lines += [f"- `{name}`: " + ", ".join(f"{k} ULP: {v}" for k, v in h.items()) for name, h in histograms]
        if figures:
            lines += ["", "### Where the mismatches sit (pictures; all of it inline in report.html)", ""]
            for name, files in figures.items():
                lines += [f"- `{name}`: [map]({files['map']}) · [ULP histogram]({files['ulp']})", "",
                          f"  ![{name} map]({files['map']})", ""]

    lines += refeed.markdown(result.refeed)
    lines += report_sections.markdown(data)
    if result.sides:
        lines += ["", "## Provenance", ""]
        for side in data["sides"]:
            meta = {k: v for k, v in side["meta"].items() if k not in ("versions", "implementation")}
            lines += [f"### side {side['label']}: {side['runner']} (`{side['python']}`)", "", "```json",
                      json.dumps(meta, indent=2, sort_keys=True, default=str), "```", ""]
        for side in data["sides"]:
            if side["status"] != "ok" and side["stderr_tail"]:
                lines += [f"### stderr tail of side {side['label']} ({side['runner']})", "", "```",
                          side["stderr_tail"].rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _model_lines(data: dict) -> list[str]:
    """Model cases: how many of the canonical gradients and module outputs are bitwise equal, where they part."""
    summary = data.get("model") or {}
    if not summary:
        return []
    g, m = summary["gradients"], summary["module_outputs"]
    lines = [f"- **{g['bitwise_pass']} of {g['total']} canonical gradients BITWISE_PASS**; "
             f"**{m['bitwise_pass']} of {m['compared']} module outputs compared BITWISE_PASS** "
             f"({m['not_compared']} not compared); logits {summary['logits']}, loss {summary['loss']}"]
    if summary["first_divergence"]:
        lines.append(f"- first divergence (forward, then backward): module `{summary['first_divergence_module']}` "
                     f"(`{summary['first_divergence']}`); first gradient: `{summary['first_gradient_divergence']}`")
    for name, why in summary["not_compared"].items():
        lines.append(f"- not compared: `{name}`: {why}")
    semantic = summary.get("semantic")
    if semantic:
        state = ("passed" if semantic["ok"] else f"FAILED: mapping error at `{semantic['first_mismatch']}` "
                 f"(module `{semantic['first_module']}`)")
        lines.append(f"- float64 semantic check {state}: max relative error at scale "
                     f"{semantic['max_relative_error']:.3g} (limit {semantic['agreement']:.0e}"
                     + (f"; floors stated for {len(semantic['floors'])} tensors" if semantic["floors"] else "") + ")")
    return lines


def _tensor_parallel_lines(data: dict) -> list[str]:
    """How the sides were launched and gathered, and, for a TP=N vs TP=M run, which tensors are TP-invariant."""
    lines = []
    c = data["comparison"]
    if c:
        lines.append(f"- comparison: {c['runner']} at TP={c['tp_a']} (side a) against {c['runner']} at "
                     f"TP={c['tp_b']} (side b); no case expectation applies")
        if "tp_invariant" in c:
            lines.append(f"- TP-invariant (bitwise equal): {', '.join(c['tp_invariant']) or 'none'}; "
                         f"not TP-invariant: {', '.join(c['not_tp_invariant']) or 'none'}")
    for side in data["sides"]:
        launch, gather = side["meta"].get("launch"), side["meta"].get("gather", {})
        if not launch:
            continue
        parts = [f"{name}: " + (f"split on dim {g['split_dim']}" if "split_dim" in g else
                                "replicated, identical on every rank" if g["identical_across_ranks"] else
                                f"replicated, DIFFERS between ranks (mismatches vs rank 0: {g['mismatches_vs_rank0']})")
                 for name, g in gather.items()]
        lines.append(f"- side {side['label']} launched by {launch['launcher']} with {launch['tp']} ranks at "
                     f"{launch.get('master', '')}" + (f"; gathered: {'; '.join(parts)}" if parts else ""))
    return lines


def console(result: CaseResult, run_dir: Path, out: Console | None = None) -> None:
    out = out or Console(width=None if Console().is_terminal else 160)
    pair = " vs ".join(result.case["runners"]) if result.case else ""
    table = Table(title=f"{result.case_name} on {result.device}" + (f": {pair}" if pair else ""))
    for column in ("tensor", "status", "mismatches", "share", "max ULP", "p99 ULP", "sign flips",
                   "max abs err", "ULPs at scale"):
        table.add_column(column, justify="left" if column in ("tensor", "status") else "right")
    rows = [t.to_dict() for t in result.tensors]
    for t in model_level.group_rows(rows) if result.model else rows:
        table.add_row(t["name"], t["status"], str(t["mismatches"]), f"{t['mismatch_share']:.4%}", str(t["max_ulp"]),
                      str(t["p99_ulp"]), str(t["sign_flips"]), f"{t['max_abs_error']:.3g}",
                      f"{t['max_error_in_scale_ulps']:.3g}", style="green" if t["status"] == "EQUAL" else "red")
    if result.tensors:
        out.print(table)
    for side in result.sides:
        implementation = side.meta.get("implementation", "")
        out.print(escape(f"side {side.label}: {side.runner} [{side.status}] {implementation} "
                         f"({side.wall_seconds:.1f} s){': ' + side.reason if side.reason else ''}"))
    for line in report_sections.console_lines(result.to_dict()):
        out.print(line, highlight=False)
    out.print(f"[{VERDICT_STYLE[result.verdict]}]{result.verdict}[/] {escape(result.message)}", highlight=False)
    if result.first_divergence:
        out.print(f"first divergence: {result.first_divergence}")
    for line in _model_lines(result.to_dict()):
        out.print(escape(line.lstrip("- ").replace("**", "").replace("`", "")), highlight=False)
    if result.refeed.get("stages"):
        out.print(f"re-feed: first tensor made locally: {result.refeed['first_local_divergence'] or 'none'}")
        for name, how in result.refeed["tensors"].items():
            out.print(f"  {name}: {how}")
    if result.expectation.get("stated") and result.expectation["verdict"] != "BITWISE_PASS":
        met = "met" if result.expectation["met"] else "NOT met"
        out.print(f"expected {result.expectation['verdict']}: {met}")
    out.print(f"report: {run_dir / 'report.md'}  (exit code {result.exit_code})")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
