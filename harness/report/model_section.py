"""Model cases (op causal_lm): the head of the report in the model's terms: how many of the canonical gradients and
module outputs are bitwise equal, the first divergence as a module path, what was not compared and why, and the
float64 semantic check. Data from ``harness.compare.model_outputs`` (``CaseResult.model``); nothing is computed here."""

from __future__ import annotations

from harness.report.blocks import h, ul


def items(data: dict) -> list[str]:
    summary = data.get("model") or {}
    if not summary:
        return []
    g, m = summary["gradients"], summary["module_outputs"]
    idle = sum(summary.get("idle_experts", {}).values())
    of_idle = (f" ({g['bitwise_pass_of_idle_experts']} of them of the {idle} routed experts no token went to: zero on "
               "both sides)" if idle else "")
    lines = [f"**{g['bitwise_pass']} of {g['total']} canonical gradients BITWISE_PASS**{of_idle}; "
             f"**{m['bitwise_pass']} of {m['compared']} module outputs compared BITWISE_PASS** "
             f"({m['not_compared']} not compared); logits {summary['logits']}, loss {summary['loss']}"]
    if summary["first_divergence"]:
        lines.append(f"first divergence (forward, then backward): module `{summary['first_divergence_module']}` "
                     f"(`{summary['first_divergence']}`); first gradient: `{summary['first_gradient_divergence']}`")
    for name, why in summary["not_compared"].items():
        lines.append(f"not compared: `{name}`: {why}")
    semantic = summary.get("semantic")
    if semantic:
        state = ("passed" if semantic["ok"] else f"FAILED: mapping error at `{semantic['first_mismatch']}` "
                 f"(module `{semantic['first_module']}`)")
        floors = f"; floors stated for {len(semantic['floors'])} tensors" if semantic["floors"] else ""
        lines.append(f"float64 semantic check {state}: max relative error at scale "
                     f"{semantic['max_relative_error']:.3g} (limit {semantic['agreement']:.0e}{floors})")
    return lines


def blocks(data: dict, figures: dict) -> list[tuple]:
    lines = items(data)
    return [h(2, "Model level"), ul(lines)] if lines else []
