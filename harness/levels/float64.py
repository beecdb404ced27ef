"""A float64 case's semantic verdict, shared by the model and training levels: in float64 the sides must agree to
~1e-10 (``harness.compare.model_outputs.semantic_check``); beyond it is a mapping error (ERROR), within it the rounding
differences are no finding (WITHIN_TOLERANCE); never a numeric DIFF."""

from __future__ import annotations

from harness.compare.result import ERROR, CaseResult, rank_departures


def semantic_verdict(result: CaseResult, check: dict, summary: dict) -> None:
    """Apply `check` to the verdict; `summary`: where the check is kept (the model's or the training run's)."""
    summary["semantic"] = check
    if result.verdict not in ("DIFF", "BITWISE_PASS"):
        return
    if not check["ok"]:
        beyond = check["tensors_beyond"][0]
        where = (f"step {check['first_step']}, tensor {check['first_mismatch']} ({check['judged_by']})"
                 if check.get("first_step") else f"{check['first_mismatch']} (module {check['first_module']})")
        result.verdict = ERROR
        result.message = (f"float64 semantic check failed: mapping error at {where}: relative error "
                          f"{beyond['relative_error']:.3g} > {beyond['limit']:.0e}; {len(check['tensors_beyond'])} "
                          "tensor(s) beyond (first 20 listed)")
    elif result.verdict == "DIFF" and not rank_departures(result.sides):  # a rank's departure is no rounding
        result.verdict = "WITHIN_TOLERANCE"
        floors = check["floors"]
        stated = (f", or the float32 floor a framework states for {len(floors)} of them (up to "
                  f"{max(floors.values()):.0e})") if floors else ""
        parts = "".join(f"; {part['judged_by']}: {part['checked']}" for part in check.get("parts", []))
        result.message = (f"float64 semantic check passed: all {check['checked']} tensors{parts}, agree to relative "
                          "error "
                          f"{check['max_relative_error']:.3g} at most, each within its limit ({check['agreement']:.0e}"
                          f"{stated}) (bits differ: {result.message})")
