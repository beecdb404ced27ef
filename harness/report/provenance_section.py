"""The end of a run's report: what each side says about itself (collapsed: long, read when bits change),
what the harness ran with, and the stderr tail of every side that failed (open: it is the news)."""

from __future__ import annotations

import json

from harness.report.blocks import details, h, pre

HIDDEN_META = ("versions", "implementation")  # already in the Runners table


def provenance(data: dict, figures: dict) -> list[tuple]:
    if not data["sides"]:
        return []
    out = [h(2, "Provenance")]
    for side in data["sides"]:
        meta = {k: v for k, v in side["meta"].items() if k not in HIDDEN_META}
        out.append(details(f"side {side['label']}: {side['runner']} (`{side['python']}`)", [pre(_json(meta), "json")]))
    harness = {"harness": data["harness"], "checkpoint": data["checkpoint"]}
    return out + [details("harness and checkpoint", [pre(_json(harness), "json")])]


def stderr_tails(data: dict, figures: dict) -> list[tuple]:
    out = []
    for side in data["sides"]:
        if side["status"] != "ok" and side["stderr_tail"]:
            out += [h(3, f"stderr tail of side {side['label']} ({side['runner']})"), pre(side["stderr_tail"])]
    return out


def _json(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)
