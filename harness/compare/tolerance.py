"""Whether a comparison met the case's tolerance policy (``harness.case.tolerance``), tensor by tensor.

Limits read the comparator's own statistics, so the report's numbers and the decision can never disagree.
"""

from __future__ import annotations

from harness.case.tolerance import LIMITS, Tolerance
from harness.compare.tensors import DIFF, EQUAL, TensorComparison


def judge(policy: Tolerance | None, comparisons: list[TensorComparison]) -> dict:
    """Per tensor: each limit, the measured value and the margin left (negative when exceeded)."""
    if policy is None:
        return {}
    tensors = [_judge_tensor(policy.for_tensor(c.name), c) for c in comparisons]
    return {"policy": {"limits": policy.limits, "tensors": policy.tensors},
            "within": all(t["within"] for t in tensors), "tensors": tensors}


def _judge_tensor(limits: dict[str, float], comparison: TensorComparison) -> dict:
    checks = []
    for key, limit in limits.items():
        measured = getattr(comparison, LIMITS[key][0])
        checks.append({"limit": key, "value": limit, "measured": measured, "margin": limit - measured,
                       "met": measured <= limit})
    problems = []
    if comparison.status not in (EQUAL, DIFF):
        problems.append(f"status {comparison.status}")
    elif comparison.status == DIFF:
        if not limits:
            problems.append("no tolerance stated for this tensor, so it must be bitwise equal")
        if comparison.nan_mismatches:
            problems.append(f"{comparison.nan_mismatches} elements are NaN on one side only")
        problems += [f"{c['limit']} {c['measured']:.6g} > {c['value']:.6g}" for c in checks if not c["met"]]
    return {"name": comparison.name, "status": comparison.status, "checks": checks, "problems": problems,
            "within": not problems}
