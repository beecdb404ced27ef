"""``python -m harness baseline update [--from NIGHT]``: record a night's verdicts as its platform's baseline.

Writes ``baselines/<readable name>.json`` for the night's platform fingerprint (or rewrites the file that already
holds that fingerprint), printing what it changes case by case. A case the night did not run keeps its old
record; a case no longer in the night is dropped. A night with any ERROR is refused, naming the cases.
Exit codes: 0 written (or nothing to change, or ``--dry-run``), 1 refused (an ERROR in the night), 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.commands import nightly, run_folder
from harness.compare import baseline

EXIT_REFUSED, EXIT_BAD_INPUT = 1, 2
SIGNS = {"added": "+", "removed": "-", "changed": "~", "kept": "="}


def add_parser(commands) -> None:
    parser = commands.add_parser("baseline", help="known verdicts per platform: record a night as the baseline")
    actions = parser.add_subparsers(dest="baseline_action", required=True)
    update = actions.add_parser("update", help="write a night's verdicts as the baseline of its platform")
    update.add_argument("--from", dest="night", type=Path,
                        help="nightly run directory or its report.json (default: the newest nightly under --reports)")
    update.add_argument("--device", choices=("cpu", "gpu"), help="with no --from: the newest night of this device")
    update.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)
    update.add_argument("--baselines", type=Path, default=baseline.BASELINES_DIR)
    update.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")


def main(args) -> int:
    try:
        night = nightly.load_previous(args.night) if args.night else newest_night(args.reports, args.device)
        existing = baseline.load_all(args.baselines)
    except (nightly.NightlyError, baseline.BaselineError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print_ = baseline.fingerprint(night)
    previous = next((b for b in existing if b["fingerprint"] == print_), None)
    try:
        new, changes = baseline.build(night, previous)
    except baseline.BaselineError as error:
        print(f"refused: {error}", file=sys.stderr)
        return EXIT_REFUSED
    target = Path(previous["_file"]) if previous else Path(args.baselines) / baseline.file_name(print_)
    source = night.get("_path", "")
    if previous:
        print(f"baseline {target} (fingerprint {new['fingerprint_id']}) from {source}:")
    else:
        print(f"new baseline {target} (fingerprint {new['fingerprint_id']}) from {source}:")
        for field in _flat(print_):
            print(f"  {field}")
    for change in changes:
        details = change["details"]
        print(f"{SIGNS[change['change']]} {change['case']}: {change['change']}"
              + (f": {details[0]}" if len(details) == 1 else ""))
        if len(details) > 1:
            for detail in details:
                print(f"    {detail}")
    unchanged = len(new["cases"]) - sum(c["change"] in ("added", "changed", "kept") for c in changes)
    print(f"{unchanged} case(s) unchanged; {len(new['cases'])} in the baseline")
    real_changes = [c for c in changes if c["change"] != "kept"]
    if previous and not real_changes:
        print("no change to the known verdicts: file left as it is")
        return 0
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(baseline.dumps(new))
    print(f"wrote {target}")
    return 0


def newest_night(reports: Path, device: str | None) -> dict:
    """The newest readable nightly report under `reports` (of `device` when given)."""
    candidates = [night for d in ([device] if device else ["cpu", "gpu"])
                  if (night := nightly.find_previous(Path(reports), d))]
    if not candidates:
        raise nightly.NightlyError(f"{reports}: no nightly report" + (f" for {device}" if device else "")
                                   + "; give one with --from")
    return max(candidates, key=lambda night: Path(night["_path"]).parent.name)


def _flat(print_: dict) -> list[str]:
    return [f"{key}: {value}" for key, value in baseline.flatten(print_)]
