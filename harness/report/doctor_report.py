"""The doctor's answer as Markdown: each runner (interpreter, versions, device, kernels), then per op which
implementation each runner would run here and, on the Paddle side, why each higher level is unavailable."""

from __future__ import annotations

DTYPES = ("bfloat16", "float32")


def markdown(doctor: dict) -> str:
    host = doctor["harness"]["host"]
    lines = [f"# harness doctor ({doctor['device']})", "",
             f"Host: {host.get('cpu')}; ISA: {' '.join(host.get('cpu_isa', [])) or 'none listed'}; "
             f"{host.get('logical_cpus')} logical CPUs.", "", "## Runners", ""]
    for name, answer in doctor["runners"].items():
        state = ("ok" if answer.get("ok") else f"NOT PROBED: {answer.get('reason')}" if answer.get("not_probed") else
                 f"BROKEN (installed, does not import; its cells are ERRORs): {answer.get('reason')}"
                 if answer.get("broken") else f"NOT USABLE: {answer.get('reason')}")
        lines.append(f"- **{name}** ({answer.get('python')}): {state}")
        versions = answer.get("versions") or {}
        if versions:
            lines.append("  - versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        for key in ("torch_cpu_capability", "gpu", "compiled_with_cuda", "paddle_onednn", "device_problem", "note"):
            if key in answer:
                lines.append(f"  - {key}: {answer[key]}")
        if answer.get("kernels"):
            present = {d: [k for k, v in answer["kernels"].items() if v.get(d) == "ok"] for d in DTYPES}
            absent = [k for k, v in answer["kernels"].items() if v.get("bfloat16") != "ok"]
            lines.append(f"  - bf16 kernels that exist on {doctor['device']}: "
                         f"{', '.join(present['bfloat16']) or 'none'}"
                         f"; missing: {', '.join(absent) or 'none'}")
    lines += ["", "## What would run, op by op", ""]
    ops = _ops(doctor)
    header = ["op", "dtype"] + list(doctor["runners"])
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for op in ops:
        for dtype in DTYPES:
            cells = [_cell(answer, op, dtype) for answer in doctor["runners"].values()]
            lines.append("| " + " | ".join([op, dtype, *cells]) + " |")
    paddle = doctor["runners"].get("paddle", {})
    if paddle.get("ops"):
        lines += ["", "## Paddle levels: why each is or is not available", ""]
        for op, by_dtype in paddle["ops"].items():
            for dtype, survey in by_dtype.items():
                runs = survey["would_run"] or ("nothing (ERROR: broken level)" if survey.get("broken") else
                                               "nothing (UNSUPPORTED)")
                lines.append(f"- `{op}` {dtype}: runs **{runs}**")
                for level, why in survey["levels"].items():
                    lines.append(f"  - {level}: {why}")
    return "\n".join(lines) + "\n"


def _ops(doctor: dict) -> list[str]:
    names: list[str] = []
    for answer in doctor["runners"].values():
        for op in answer.get("ops") or {}:
            if op not in names:
                names.append(op)
    return names


def _cell(answer: dict, op: str, dtype: str) -> str:
    if answer.get("broken") and not answer.get("ops"):
        return "runner broken"
    if answer.get("not_probed"):
        return "not probed"
    if not answer.get("ok") and not answer.get("broken"):
        return "runner not usable"
    table = answer.get("ops") or {}
    entry = table.get(op, table.get(op.split("+")[0]))  # a variant (swiglu+per_token_scale) of a runner's op
    if entry is None:
        return "-"
    if dtype in entry:  # per dtype (the Paddle side)
        entry = entry[dtype]
        return entry["would_run"] or ("ERROR (broken level)" if entry.get("broken") else "UNSUPPORTED")
    return (entry.get("would_run") or "none").split(".")[-1] if entry.get("would_run") else "none"
