"""What a night keeps of a case's folder once the case is judged (issue 47: a CPU night kept 60 GB of tensors and filled
its disk; a MiniMax-M2 training case alone kept 1.4 GB a side).

Reports, pictures, meta, logs and digests stay for every case. Tensor files (``*.safetensors``: outputs, rank files,
training step files) stay only for a case the night fails, or with ``--keep``; of a failing training case only the step
files of the step that shows the first divergence stay whole (every tensor's digest of every step is in report.json).
The case's report.md says what went and the command that makes it again.

What a passing night leaves is its reports (issue 47: 17 MB for a MiniMax-M2 training case, a record per tensor per
step, and as much again in the night's report.json), so of a case the night does not fail its report.json is kept
gzip-compressed (``report.json.gz``, a tenth of it), and the night's report.json embeds of each tensor record only the
fields the night's readers use (``night_result``: the baseline's records, the trend, the night's report), the case's
own report.json keeping them all.
"""

from __future__ import annotations

import gzip
import re
import shlex
from pathlib import Path

from harness import resources
from harness.baselines.records import TENSOR_FIELDS

TENSOR_FILES = "*.safetensors"
STEP_FILE = re.compile(r"step(\d+)(?:\.rank\d+)?\.safetensors\Z")
DIVERGENCE_STEP = re.compile(r"step(\d+)\.")


# of each tensor record, what the night's report.json embeds: harness.baselines.records (TENSOR_FIELDS, digests: a
# baseline's record and equal_bits), harness.baselines.trend and harness.report.nightly_report (status, mismatches,
# max_ulp); a count that is 0 is left out (every reader takes a missing count as 0), the four always there
NIGHT_TENSOR_FIELDS = ("name", *TENSOR_FIELDS, "dtype", "shape", "digests", "note")
ALWAYS = ("name", "status", "mismatches", "max_ulp")
REPORT_JSON = "report.json"


def night_result(result: dict) -> dict:
    """A case's result as the night's report.json embeds it: every field, each tensor record cut to what the night's
    readers use (NIGHT_TENSOR_FIELDS)."""
    return {**result, "tensors": [{key: tensor[key] for key in NIGHT_TENSOR_FIELDS
                                   if key in tensor and (key in ALWAYS or tensor[key])}
                                  for tensor in result.get("tensors") or []]}


def compress_report(case_dir: Path) -> dict:
    """The case's report.json, gzip-compressed in place (``report.json.gz``); its bytes before and after ({} when
    there is none to compress)."""
    source, target = case_dir / REPORT_JSON, case_dir / (REPORT_JSON + ".gz")
    if not source.is_file():
        return {}
    with resources.boundary("case folder", case_dir):
        data = source.read_bytes()
        with gzip.open(target, "wb", compresslevel=6) as out:
            out.write(data)
        source.unlink()
    return {"report": target.name, "report_bytes": len(data), "report_gz_bytes": target.stat().st_size}


def prune(case_dir: Path, failed: bool, first_divergence: str | None) -> dict:
    """Delete the tensor files a reader of this case does not need (module docstring); what went and what stayed."""
    step = DIVERGENCE_STEP.match(first_divergence or "")
    kept_step = int(step.group(1)) if step else None
    deleted, kept = [], []
    for file in sorted(case_dir.rglob(TENSOR_FILES)):
        is_step = STEP_FILE.match(file.name)
        keep = failed and (not is_step or kept_step is None or int(is_step.group(1)) == kept_step)
        (kept if keep else deleted).append(file)
    freed = 0
    with resources.boundary("case folder", case_dir):
        for file in deleted:
            freed += file.stat().st_size
            file.unlink()
    return {"tensors": "kept" if not deleted else "some kept" if kept else "deleted",
            "deleted_files": len(deleted), "deleted_bytes": freed, "kept_files": len(kept),
            "kept_bytes": sum(file.stat().st_size for file in kept), "kept_step": kept_step if failed else None}


def rerun_command(case: str, device: str, tokens: int | None, weights: str | None) -> str:
    """The command that runs the case again as the night did, every tensor kept."""
    words = ["python", "-m", "harness", "compare", case, "--device", device]
    words += ["--tokens", str(tokens)] if tokens else []
    words += ["--weights", weights] if weights else []
    return shlex.join(words)


def note(report: Path, kept: dict, rerun: str) -> None:
    """Say in the case's report.md what the night deleted and how to get it back."""
    if not kept["deleted_files"] and not kept.get("report"):
        return
    what = (f"deleted {kept['deleted_files']} tensor files ({resources.human_bytes(kept['deleted_bytes'])}) once it "
            "had judged the case")
    if kept["kept_files"]:
        step = f", whole tensors of step {kept['kept_step']} only (its first divergence)" if kept["kept_step"] else ""
        what += f"; kept {kept['kept_files']} ({resources.human_bytes(kept['kept_bytes'])}){step}"
    with resources.boundary("report", report), report.open("a") as out:
        digests = (f"report.json, kept gzip-compressed: `{kept['report']}`, read it with `gzip -dk {kept['report']}`"
                   if kept.get("report") else "report.json")
        out.write(f"\n## Files the night kept\n\n- The night {what}. Reports, pictures, meta, logs and every tensor's "
                  f"digest ({digests}) are kept.\n- To get every tensor back, run the case again: `{rerun}`\n")
