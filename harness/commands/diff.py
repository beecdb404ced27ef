"""``python -m harness diff A B``: two dumps compared like a case's outputs, with the same reports and exit codes.

No case and no runner: the result's verdict comes from the tensors alone (BITWISE_PASS, DIFF, or ERROR for
a missing tensor, a dtype or shape mismatch, or a dump that cannot be read).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from harness import __version__
from harness.compare.dumps import Dump, compare_dumps
from harness.compare.result import CaseResult, decide
from harness.pipeline import failsafe, run_folder
from harness.report import case_report as report
from harness.run.protocol import host_provenance


def diff_dumps(a: Path, b: Path, *, name_map: dict[str, str] | None = None, layouts: dict[str, str] | None = None,
               dtype_hints: dict[str, str] | None = None,
               reports_dir: Path = run_folder.REPORTS_DIR) -> tuple[CaseResult, Path]:
    run_id, run_dir = run_folder.new_run_dir(Path(reports_dir), "diff")
    inputs = {"a": str(a), "b": str(b), "name_map": name_map or {}, "layouts": layouts or {},
              "dtype_hints": dtype_hints or {}}
    result = CaseResult(run_id=run_id, case_name=f"diff {Path(a).name} {Path(b).name}", device="files",
                        started_at=run_folder.now(),
                        harness={"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                                 "numpy": np.__version__, "host": host_provenance(), "inputs": inputs})
    try:
        result.tensors, result.harness["comparator_memory"] = compare_dumps(
            Dump.open(a), Dump.open(b), name_map, layouts, dtype_hints)
        result.verdict, result.message = decide([], result.tensors)
    except BaseException as error:  # every failure, the harness's own and a signal included: a verdict, a report
        failsafe.record(result, error)
    failsafe.finish(result, run_dir, report.write)
    return result, run_dir
