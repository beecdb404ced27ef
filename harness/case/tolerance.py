"""Tolerance policy: what a case accepts short of bitwise equality (judged by ``harness.compare.tolerance``).

Bitwise stays the default. A case may state, for all tensors and/or per tensor::

    tolerance.max_ulp_at_scale = 1.0      # dotted keys (TOML forbids adding to an inline table)
    tolerance.max_mismatch_share = 0.5
    tolerance.tensors."grad.weight" = { max_ulp = 4 }

A per-tensor table overrides the shared limits key by key. Every stated limit must hold (they are
ANDed); a tensor with no limit at all must stay bitwise equal; a NaN on one side only is never
within tolerance. Limits read the comparator's own statistics (``harness.compare``), so the report's
numbers and the decision can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# limit name -> (the TensorComparison field it bounds, the type a case must give, what it means)
LIMITS = {
    "max_ulp_at_scale": ("max_error_in_scale_ulps", (int, float), "max abs error over the ULP at the tensor's scale"),
    "max_mismatch_share": ("mismatch_share", (int, float), "share of elements whose bits differ (0..1)"),
    "max_ulp": ("max_ulp", (int,), "largest ULP distance of any element"),
}


@dataclass(frozen=True)
class Tolerance:
    limits: dict[str, float] = field(default_factory=dict)  # for every tensor
    tensors: dict[str, dict[str, float]] = field(default_factory=dict)  # per-tensor overrides

    def for_tensor(self, name: str) -> dict[str, float]:
        return {**self.limits, **self.tensors.get(name, {})}


def parse(f, outputs: list[str]) -> Tolerance | None:
    """The case's `tolerance` table, validated; `f` is the case's field reader (harness.case.registry._Fields)."""
    table = f.get("tolerance", dict, None)
    if table is None:
        return None
    shared = _limits(f, {k: v for k, v in table.items() if k != "tensors"}, "tolerance")
    per_tensor = {}
    for name, limits in f.get("tensors", dict, {}, where=table, label="tolerance.tensors").items():
        label = f"tolerance.tensors.{name}"
        if name not in outputs:
            raise f.error(label, f"no such output; outputs: {', '.join(outputs)}", limits)
        if not isinstance(limits, dict):
            raise f.error(label, "must be a table like { max_ulp = 2 }", limits)
        per_tensor[name] = _limits(f, limits, label)
    if not shared and not any(per_tensor.values()):
        raise f.error("tolerance", f"states no limit; give one or more of {', '.join(LIMITS)}", table)
    return Tolerance(shared, per_tensor)


def _limits(f, table: dict, label: str) -> dict[str, float]:
    limits = {}
    for key, value in table.items():
        if key not in LIMITS:
            raise f.error(f"{label}.{key}", f"unknown limit; known: {', '.join(LIMITS)} (and tensors)", value)
        kinds = LIMITS[key][1]
        if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
            kind = "a non-negative integer" if kinds == (int,) else "a non-negative number"
            raise f.error(f"{label}.{key}", f"must be {kind}", value)
        if key == "max_mismatch_share" and value > 1:
            raise f.error(f"{label}.{key}", "is a share of elements, at most 1", value)
        limits[key] = value
    return limits
