"""The re-feed section (``harness.compare.refeed``): one row per block tensor, in the stages' order, saying
whether its op made the difference or was handed it."""

from __future__ import annotations

from harness.report.blocks import h, table, ul


def blocks(data: dict, figures: dict) -> list[tuple]:
    refeed = data.get("refeed") or {}
    if not refeed:
        return []
    out = [h(2, "Re-feed (each op re-run on side b from side a's tensors)")]
    if "error" in refeed:
        return out + [ul([refeed["error"]])]
    rows = []
    for stage in refeed["stages"]:
        if not stage["tensors"]:
            rows.append([stage["stage"], stage["op"], f"{stage['status']}: {stage['reason']}", "", "", "", ""])
        for t in stage["tensors"]:
            rows.append([stage["stage"], stage["op"], stage["status"], t["name"], t["mismatches"], t["max_ulp"],
                         refeed["tensors"].get(t["name"], "")])
    return out + [
        ul([f"runner `{refeed['runner']}` fed from {refeed['fed_from']}; first tensor made locally: "
            f"**{refeed['first_local_divergence'] or 'none'}**"]),
        table(["stage", "op", "status", "tensor", "re-fed mismatches", "max ULP", "attribution"], rows, "llllrrl")]
