"""``python -m harness baseline update [--from NIGHT]`` records a night's verdicts as the baselines of the platforms it
ran on; ``python -m harness baseline record [nightly options]`` runs a night and records it, in one command.

Writes ``baselines/<readable name>.json`` per platform (or rewrites the file that already holds that platform),
printing what it changes case by case. A case the night did not run keeps its old record; a case no longer in the
night is dropped. A night with any ERROR is refused, naming the cases, and so is a shard (merge the shards first).
Exit codes: 0 written (or nothing to change, or ``--dry-run``), 1 refused (an ERROR in the night), 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.baselines import records, store
from harness.commands import nightly
from harness.pipeline import run_folder

EXIT_REFUSED, EXIT_BAD_INPUT = 1, 2
SIGNS = {"added": "+", "removed": "-", "changed": "~", "kept": "="}


def add_parser(commands) -> None:
    parser = commands.add_parser("baseline", help="known verdicts per platform: record a night as the baseline")
    actions = parser.add_subparsers(dest="baseline_action", required=True)
    update = actions.add_parser("update", help="write a night's verdicts as the baseline of its platforms")
    update.add_argument("--from", dest="night", type=Path,
                        help="nightly run directory or its report.json (default: the newest nightly under --reports)")
    update.add_argument("--device", choices=("cpu", "gpu"), help="with no --from: the newest night of this device")
    update.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)
    update.add_argument("--baselines", type=Path, default=store.BASELINES_DIR)
    update.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")
    record = actions.add_parser("record", help="run a night (the nightly's options) and write it as the baseline")
    nightly.add_run_arguments(record)
    record.add_argument("--baselines", type=Path, default=store.BASELINES_DIR)
    record.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")


def main(args, pythons: dict[str, str]) -> int:
    try:
        existing = store.load_all(args.baselines)
        if args.baseline_action == "record":
            night, run_dir = nightly.run_from_args(args, pythons, args.baselines)
            nightly.print_summary(night, run_dir)
            night["_path"] = str(run_dir / "report.json")
        else:
            night = nightly.load_previous(args.night) if args.night else newest_night(args.reports, args.device)
    except (nightly.NightlyError, store.BaselineError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return update(night, existing, Path(args.baselines), args.dry_run)


def update(night: dict, existing: list[dict], baselines_dir: Path, dry_run: bool) -> int:
    """Write the baselines `night` makes (one per platform it ran on), printing each one's changes."""
    try:
        built = store.build(night, existing)
    except store.BaselineError as error:
        print(f"refused: {error}", file=sys.stderr)
        return EXIT_REFUSED
    for new, changes, previous in built:
        _write(new, changes, previous, baselines_dir, night.get("_path", ""), dry_run)
    return 0


def _write(new: dict, changes: list[dict], previous: dict | None, baselines_dir: Path, source: str,
           dry_run: bool) -> None:
    target = Path(previous["_file"]) if previous else baselines_dir / records.file_name(new["platform"])
    if previous:
        print(f"baseline {target} (platform {new['platform_id']}) from {source}:")
        for d in records.differences(previous["runners"], new["runners"]):
            print(f"~ runners.{d['field']}: {d['baseline'] or '(absent)'} → {d['tonight'] or '(absent)'}")
    else:
        print(f"new baseline {target} (platform {new['platform_id']}) from {source}:")
        for key, value in records.flatten(new["platform"]):
            print(f"  {key}: {value}")
    for change in changes:
        details = change["details"]
        print(f"{SIGNS[change['change']]} {change['case']}: {change['change']}"
              + (f": {details[0]}" if len(details) == 1 else ""))
        if len(details) > 1:
            for detail in details:
                print(f"    {detail}")
    unchanged = len(new["cases"]) - sum(c["change"] in ("added", "changed", "kept") for c in changes)
    print(f"{unchanged} case(s) unchanged; {len(new['cases'])} in the baseline")
    unchanged_file = previous and store.dumps(new) == store.dumps(
        {**previous, "recorded_from": new["recorded_from"]})
    if unchanged_file:
        print("no change to the known verdicts: file left as it is")
        return
    if dry_run:
        print("dry run: nothing written")
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(store.dumps(new))
    print(f"wrote {target}")


def newest_night(reports: Path, device: str | None) -> dict:
    """The newest readable nightly report under `reports` (of `device` when given)."""
    candidates = [night for d in ([device] if device else ["cpu", "gpu"])
                  if (night := nightly.find_previous(Path(reports), d))]
    if not candidates:
        raise nightly.NightlyError(f"{reports}: no nightly report" + (f" for {device}" if device else "")
                                   + "; give one with --from")
    return max(candidates, key=lambda night: Path(night["_path"]).parent.name)
