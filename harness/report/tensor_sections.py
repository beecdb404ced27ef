"""The run's comparison itself: who ran (runners), what differs (tensors, ULP histograms) and where it sits
(the pictures, linked from report.md and embedded in report.html)."""

from __future__ import annotations

from harness.report.blocks import figure, h, p, table, ul


def runners(data: dict, figures: dict) -> list[tuple]:
    if not data["sides"]:
        return []
    rows = []
    for side in data["sides"]:
        meta = side["meta"]
        versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
        status = side["status"] + (f": {side['reason']}" if side["reason"] else "")
        kernels = "\n".join(meta.get("onednn_kernels", [])) or "none"
        rows.append([side["label"], side["runner"], status, meta.get("implementation", ""), kernels, versions,
                     side["wall_seconds"]])
    return [h(2, "Runners"),
            table(["side", "runner", "status", "implementation", "oneDNN kernels run", "versions", "wall s"], rows,
                  "llllllr")]


def tensors(data: dict, figures: dict) -> list[tuple]:
    if not data["tensors"] or data.get("train"):  # a training run's tensors: per step, in its own section
        return []
    rows = []
    for t in _rows(data, data["tensors"]):
        first = t["first_mismatch"]
        where = f"{first['index']}: {first['a_bits']} vs {first['b_bits']}" if first else t.get("note", "")
        rows.append([t["name"], t["status"], t["dtype"], t["shape"], t["mismatches"], f"{t['mismatch_share']:.4%}",
                     t["max_ulp"], t["p99_ulp"], t["sign_flips"], f"{t['max_abs_error']:.3g}",
                     f"{t['max_rel_error']:.3g}", f"{t['max_error_in_scale_ulps']:.3g}", t["signed_zero_diffs"],
                     t["nan_payload_diffs"] + t["nan_mismatches"], where])
    out = [h(2, "Tensors (side a against side b)"),
           table(["tensor", "status", "dtype", "shape", "mismatches", "share", "max ULP", "p99 ULP", "sign flips",
                  "max abs err", "max rel err", "max err in ULPs at scale", "±0 diffs", "NaN diffs",
                  "first mismatch"], rows, "llllrrrrrrrrrrl")]
    histograms = [(t["name"], t["ulp_histogram"]) for t in _rows(data, data["tensors"]) if t["ulp_histogram"]]
    if histograms:
        out += [h(3, "ULP distance histograms (mismatching elements)"),
                ul([f"`{name}`: " + ", ".join(f"{k} ULP: {v}" for k, v in histogram.items())
                    for name, histogram in histograms])]
    return out + pictures(data, figures)


def _rows(data: dict, tensors: list[dict]) -> list[dict]:
    """A model case's per-expert tensors folded into one row per expert family (harness.compare.model_outputs)."""
    from harness.compare.model_outputs import group_rows
    return group_rows(tensors) if data.get("model") else tensors


def pictures(data: dict, figures: dict) -> list[tuple]:
    """Per differing tensor: where its mismatches sit (map) and how far apart they are (ULP histogram)."""
    if not figures:
        return []
    out = [h(3, "Where the mismatches sit")]
    summaries = {t["name"]: t.get("mismatch_map") for t in data["tensors"]}
    for name, files in figures.items():
        out += [p(f"`{name}`: {_where(summaries.get(name))}"),
                figure(files["map"], f"{name}: mismatch map"), figure(files["ulp"], f"{name}: ULP histogram")]
    return out


def _where(summary: dict | None) -> str:
    if not summary:
        return "map and ULP histogram"
    cell_h, cell_w = summary["cell_elements"]
    text = (f"{summary['cells_with_mismatches']} of {summary['cells']} cells touched "
            f"(one cell = {cell_h} x {cell_w} elements of a {summary['view'][0]} x {summary['view'][1]} view)")
    box = summary.get("bounding_box_elements")
    if box:
        text += f"; all within rows {box['rows'][0]}–{box['rows'][1]}, columns {box['cols'][0]}–{box['cols'][1]}"
    return text
