"""report.html: one self-contained page per run (verdict, tensor table, pictures inlined as base64)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from harness.compare.result import CaseResult

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}td:first-child,th{text-align:left}
.EQUAL{background:#e8f5e9}.DIFF{background:#ffebee}.verdict{font-size:1.4em}img{max-width:100%;margin:4px 0}
pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}"""
COLUMNS = [("tensor", "name"), ("status", "status"), ("dtype", "dtype"), ("shape", "shape"),
           ("mismatches", "mismatches"), ("share", "mismatch_share"), ("max ULP", "max_ulp"), ("p99 ULP", "p99_ulp"),
           ("sign flips", "sign_flips"), ("max abs err", "max_abs_error"), ("max rel err", "max_rel_error"),
           ("max err in ULPs at scale", "max_error_in_scale_ulps"), ("±0 diffs", "signed_zero_diffs"),
           ("NaN payload diffs", "nan_payload_diffs"), ("NaN vs number", "nan_mismatches")]


def write(result: CaseResult, run_dir: Path, figures: dict[str, dict[str, str]]) -> None:
    (run_dir / "report.html").write_text(render(result, run_dir, figures))


def render(result: CaseResult, run_dir: Path, figures: dict[str, dict[str, str]]) -> str:
    data = result.to_dict()
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(result.case_name)}: {e(result.verdict)}"
             f"</title><style>{STYLE}</style></head><body>",
             f"<h1>{e(result.case_name)}</h1><p class='verdict'><b>{e(result.verdict)}</b> "
             f"(exit code {result.exit_code}): {e(result.message)}</p>",
             f"<p>run <code>{e(result.run_id)}</code> on <code>{e(result.device)}</code>, "
             f"{e(result.started_at)} to {e(result.finished_at)}</p>"]
    if data["expectation"]:
        met = "met" if data["expectation"]["met"] else "NOT met: " + "; ".join(data["expectation"]["problems"])
        parts.append(f"<p>expected {e(data['expectation']['verdict'])}: {e(met)}</p>")
    if data["sides"]:
        parts.append("<h2>Runners</h2><table><tr><th>side</th><th>runner</th><th>status</th><th>implementation</th>"
                     "<th>wall s</th></tr>")
        for side in data["sides"]:
            parts.append(f"<tr><td>{e(side['label'])}</td><td>{e(side['runner'])}</td><td>{e(side['status'])} "
                         f"{e(side['reason'])}</td><td>{e(str(side['meta'].get('implementation', '')))}</td>"
                         f"<td>{side['wall_seconds']}</td></tr>")
        parts.append("</table>")
    if data["tensors"]:
        parts.append("<h2>Tensors (side a against side b)</h2><table><tr>"
                     + "".join(f"<th>{e(title)}</th>" for title, _ in COLUMNS) + "<th>first mismatch</th></tr>")
        for t in data["tensors"]:
            first = t["first_mismatch"]
            where = f"{first['index']}: {first['a_bits']} vs {first['b_bits']}" if first else t["note"]
            cells = "".join(f"<td>{e(_format(key, t[key]))}</td>" for _, key in COLUMNS)
            parts.append(f"<tr class='{e(t['status'])}'>{cells}<td>{e(where)}</td></tr>")
        parts.append("</table>")
    for t in data["tensors"]:
        if t["name"] in figures:
            parts.append(f"<h3>{e(t['name'])}</h3><p>where: {e(json.dumps(t['mismatch_map']))}</p>")
            parts += [_image(run_dir / figures[t["name"]][kind], f"{t['name']} {kind}") for kind in ("map", "ulp")]
    parts.append("<h2>Provenance</h2><pre>" + e(json.dumps(
        {"harness": data["harness"], "case": data["case"], "checkpoint": data["checkpoint"],
         "sides": [{k: v for k, v in s.items() if k != "stderr_tail"} for s in data["sides"]]},
        indent=2, default=str)) + "</pre></body></html>\n")
    return "\n".join(parts)


def _image(path: Path, alt: str) -> str:
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{encoded}'>"


def _format(key: str, value) -> str:
    if key == "mismatch_share":
        return f"{value:.4%}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
