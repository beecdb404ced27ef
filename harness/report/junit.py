"""JUnit XML for CI test views: one testcase per case of a nightly run.

A case that failed (an ERROR, an unmet expectation, a change against the baseline, a difference nothing states)
is a failure whose message starts with why; an UNSUPPORTED or not-run case is skipped with its reason; a met
expectation (bitwise pass, known difference, negative control) passes.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from harness.baselines import records


def write(night: dict, path: Path) -> None:
    cases = night["cases"]
    counts = {outcome: sum(c["outcome"] == outcome for c in cases) for outcome in ("fail", "skip")}
    suites = ET.Element("testsuites", name="bitwise-harness nightly")
    suite = ET.SubElement(suites, "testsuite", {
        "name": f"bitwise-harness nightly ({night['device']})", "tests": str(len(cases)),
        "failures": str(counts["fail"]), "errors": "0", "skipped": str(counts["skip"]),
        "time": f"{sum(c['wall_seconds'] for c in cases):.3f}", "timestamp": night["started_at"]})
    properties = ET.SubElement(suite, "properties")
    for name in ("run_id", "device", "tokens"):
        ET.SubElement(properties, "property", name=name, value=str(night.get(name) or "each case's own"))
    for case in cases:
        element = ET.SubElement(suite, "testcase", {
            "classname": f"bitwise.{night['device']}.{case.get('family') or 'case'}", "name": case["case"],
            "time": f"{case['wall_seconds']:.3f}"})
        summary = f"{case['verdict']}: {case['message']}" if case["verdict"] else case["message"]
        if case["outcome"] == "fail":
            kind = records.FAILURE_KINDS.get(case.get("failure"), "failed")
            failure = ET.SubElement(element, "failure", message=f"{kind}: {summary}", type=case["verdict"] or "ERROR")
            failure.text = "\n".join([f"{kind}: {summary}", *case["problems"], f"report: {case['report'] or '(none)'}"])
        elif case["outcome"] == "skip":
            ET.SubElement(element, "skipped", message=summary)
        if case["report"]:
            ET.SubElement(element, "system-out").text = f"report: {case['report']}"
    ET.indent(suites)
    path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n")
