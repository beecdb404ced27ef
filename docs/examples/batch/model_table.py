"""model-table.md beside gpu.sh's table.md (gpu_model.sh): per model case and stack, the M at which the sequence's
forward (module outputs, logits, loss) and its parameter gradients keep their bits, and the first tensor that moved.

    python docs/examples/batch/model_table.py REPORTS DEST "RUNNERS" "CASES"
"""
import json
import sys
from pathlib import Path


def holds(cell: dict, backward: bool) -> bool:
    return all(t.get("status") == "EQUAL" for name, t in cell["tensors"].items()
               if name.startswith("grad.") == backward)


def text(folder: Path) -> str:
    found = sorted(folder.glob("*batch-*/report.json"))
    if not found:
        return "no batch report (see log.txt)"
    report = json.loads(found[-1].read_text())
    cells, s = report["cells"], report["summary"]
    failed = [c for c in cells if not c["tensors"]]
    if failed:
        return f"{failed[0]['verdict']}: {failed[0]['message'].split(': ', 1)[-1][:110]}"
    if s["invariant"]:
        return "invariant"
    first = next(c for c in cells if c["others"] == s["first_m"])
    t = first["tensors"][s["first_tensor"]]
    forward = [c["others"] for c in cells if holds(c, False)]
    backward = [c["others"] for c in cells if holds(c, True)]
    return (f"from M={s['first_m']}: `{s['first_tensor'].removeprefix('module.model.')}` {t['mismatches']} el., max "
            f"{t['max_ulp']} ULP; forward holds at M={','.join(map(str, forward)) or 'none'}, gradients at "
            f"M={','.join(map(str, backward)) or 'none'}")


reports, dest, runners, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
rows = ["| case | " + " | ".join(runners) + " |", "|---|" + "---|" * len(runners)]
rows += [f"| {case} | " + " | ".join(text(reports / f"{case}-{runner}") for runner in runners) + " |"
         for case in cases]
(dest / "model-table.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
