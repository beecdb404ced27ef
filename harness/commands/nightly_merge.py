"""``nightly-merge DIR...``: the run directories of ``nightly --shard i/n`` runs (harness.commands.nightly_shards)
put back together into one night.

The merged night is an ordinary nightly run directory (``reports/nightly-*``): each shard's case folders are
copied under its ``cases/``, the entries come back in the registry's order, the cases are judged together against
the baselines of the platforms they ran on (``--baselines``; a shard alone judges nothing), the summary, exit code
and trend (against ``--previous`` or the newest earlier night for the device) are computed over all of them, and
``report.json`` lists the shards it came from. Shards must agree on device, token count and shard count, and
hold distinct shard numbers; a missing shard is a failure of the night (its cases did not run), never a pass.
"""

from __future__ import annotations

import platform
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from harness import __version__
from harness.baselines import store
from harness.commands import nightly
from harness.pipeline import run_folder
from harness.run.protocol import host_provenance


def add_parser(commands) -> None:
    parser = commands.add_parser("nightly-merge", help="merge the run directories of `nightly --shard` runs")
    parser.add_argument("shards", type=Path, nargs="+", help="shard run directories (or their report.json)")
    parser.add_argument("--previous", type=Path, help="previous night for the trend (default: the newest one "
                                                      "for this device under --reports)")
    parser.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)
    parser.add_argument("--baselines", type=Path, default=store.BASELINES_DIR,
                        help="folder of known verdicts per platform; the merged night is judged against them")
    parser.add_argument("--no-baselines", dest="baselines", action="store_const", const=None,
                        help="judge every case by its own expectation only")


def main(args) -> int:
    try:
        night, run_dir = merge(args.shards, Path(args.reports), args.previous, args.baselines)
    except nightly.NightlyError as error:
        print(f"error: {error}", file=sys.stderr)
        return nightly.EXIT_BAD_INPUT
    nightly.print_summary(night, run_dir)
    nightly._github_output(run_dir, night["exit_code"])
    return night["exit_code"]


def merge(shard_dirs: Sequence[Path], reports_dir: Path, previous: Path | None = None,
          baselines_dir: Path | None = None) -> tuple[dict, Path]:
    """One night from its shards, judged as one: against the baselines of each case's platform (in `baselines_dir`;
    None: by each case's own expectation), missing shards failing it."""
    shards = [nightly.load_previous(Path(path)) for path in shard_dirs]
    known = nightly.load_baselines(baselines_dir)
    for night in shards:
        if not night.get("shard"):
            raise nightly.NightlyError(f"{night['_path']}: field 'shard': not a shard (run with --shard I/N)")
    first = shards[0]
    for night in shards[1:]:
        for key in ("device", "tokens", "select"):
            if night.get(key) != first.get(key):
                raise nightly.NightlyError(f"{night['_path']}: field {key!r} is {night.get(key)!r}, but "
                                           f"{first['_path']} says {first.get(key)!r}")
        if night["shard"]["count"] != first["shard"]["count"]:
            raise nightly.NightlyError(f"{night['_path']}: field 'shard.count' is {night['shard']['count']}, "
                                       f"but {first['_path']} says {first['shard']['count']}")
    indexes = [night["shard"]["index"] for night in shards]
    if len(set(indexes)) != len(indexes):
        raise nightly.NightlyError(f"shard numbers repeat: {sorted(indexes)} ({', '.join(n['_path'] for n in shards)})")
    count = first["shard"]["count"]
    missing = sorted(set(range(1, count + 1)) - set(indexes))

    previous_night = nightly.load_previous(previous) if previous else nightly.find_previous(reports_dir,
                                                                                            first["device"])
    run_id, run_dir = nightly.new_nightly_dir(reports_dir)
    entries = []
    for night in sorted(shards, key=lambda n: n["shard"]["index"]):
        source = Path(night["_path"]).parent
        for entry in night["cases"]:
            entry = dict(entry)
            if entry.get("run_dir"):
                target = run_dir / entry["run_dir"]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(source / entry["run_dir"], target)
            entry["shard"] = night["shard"]["index"]
            entries.append(entry)
    for index in missing:
        entries.append({"case": f"shard {index}/{count}", "family": "", "expected": "", "verdict": "ERROR",
                        "exit_code": None, "problems": [], "wall_seconds": 0.0, "run_dir": None, "report": None,
                        "result": None, "outcome": "fail", "shard": index,
                        "message": f"shard {index} of {count} is missing: its cases did not run"})
    entries.sort(key=lambda e: (e.get("position", 10**9), e["case"]))
    merged = {"schema": nightly.NIGHTLY_SCHEMA, "kind": "nightly", "run_id": run_id, "device": first["device"],
              "tokens": first.get("tokens"), "cases_dir": first.get("cases_dir"), "select": first.get("select"),
              "started_at": min(n["started_at"] for n in shards), "finished_at": max(n["finished_at"] for n in shards),
              "harness": {"version": __version__, "python": sys.version.split()[0], "argv": sys.argv,
                          "host": host_provenance(), "node": platform.node()},
              "previous_report": previous_night.get("_path") if previous_night else None,
              "merged_from": [{"index": n["shard"]["index"], "count": count, "run_id": n["run_id"],
                               "report": n["_path"], "node": n.get("harness", {}).get("node"),
                               "workers": n.get("workers", 1), "cases": n["shard"]["cases"]} for n in shards],
              "missing_shards": missing, "shard": None, "cases": entries}
    nightly.finish(merged, previous_night, None if baselines_dir is None else known, str(baselines_dir))
    nightly.write(merged, run_dir)
    return merged, run_dir
