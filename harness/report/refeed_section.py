"""The re-feed section: op level (``harness.compare.refeed``: one row per block tensor, in the stages' order) and
model level (``harness.compare.model_refeed``: the tensors that differ in the full run or when re-fed, with the
re-fed unit they belong to), saying whether each was made there or handed in."""

from __future__ import annotations

from harness.report.blocks import h, table, ul


def blocks(data: dict, figures: dict) -> list[tuple]:
    refeed = data.get("refeed") or {}
    if not refeed:
        return []
    if refeed.get("kind") == "model":
        return model_blocks(refeed)
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


def model_items(refeed: dict) -> list[str]:
    """The section's head lines (the console prints them too)."""
    if "error" in refeed:
        return [refeed["error"]]
    c = refeed["counts"]
    first = refeed["first_local_divergence"]
    lines = [f"runner `{refeed['runner']}` replayed with every re-fed module's input, output and output gradient "
             f"from {refeed['fed_from']}; {len(refeed['units'])} modules re-fed",
             "first local divergence (forward, then backward): "
             + (f"**`{first}`**, made by `{refeed['first_local_unit']}`" if first else "**none**"),
             f"of the case's {sum(c.values())} output tensors and gradients: {c['made']} made by their module, "
             f"{c['carried']} carried in, {c['equal']} equal, {c['not re-fed']} not re-fed"]
    inputs = refeed.get("input_counts")
    if inputs and sum(inputs.values()):
        lines.append(f"and the {sum(inputs.values())} module inputs the replay fed (rows of their own, not outputs): "
                     f"{inputs['made']} made, {inputs['carried']} carried in, {inputs['equal']} equal, "
                     f"{inputs['not re-fed']} not re-fed")
    lines += [f"not re-fed: `{unit}`: {why}" for unit, why in refeed["not_refed"].items()]
    return lines


def model_rows(refeed: dict) -> list[list]:
    """Rows that are not equal, per-expert tensors folded into one row per family and attribution."""
    from harness.compare.model_outputs import family

    rows, folded = [], {}
    for r in refeed.get("rows", []):
        if r["attribution"] == "equal":
            continue
        key = (family(r["name"]) or r["name"], r["attribution"].split(" (")[0], r["unit"] if not family(r["name"])
               else "")
        if key in folded:
            folded[key][0] += 1
            folded[key][1][4] += r.get("mismatches") or 0
            continue
        row = [r["name"], r["unit"], r["full"] or "", r["local"] or "", r.get("mismatches") or 0, r["attribution"]]
        folded[key] = [1, row]
        rows.append(key)
    out = []
    for key in rows:
        count, row = folded[key]
        if count > 1:
            row = [f"{key[0]} ({count} tensors)", *row[1:]]
        out.append(row)
    return out


def model_blocks(refeed: dict) -> list[tuple]:
    out = [h(2, "Re-feed (each module re-run on side b from side a's tensors)"), ul(model_items(refeed))]
    if "error" in refeed:
        return out
    return out + [table(["tensor", "re-fed module", "full run", "re-fed", "re-fed mismatches", "attribution"],
                        model_rows(refeed), "llllrl")]
