"""Baselines on disk: one JSON file per platform under ``baselines/`` (``harness.baselines.records`` says what a record
holds and how a night is judged against it). Reading them (a broken or old-schema file is an error naming it),
writing a night as the baselines of the platforms it ran on (``build``, never a night with an ERROR or a shard),
and checking that a committed file still fits today's registry and fingerprint fields (``fit_problems``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from harness.baselines.records import (
    DEFINITION_FIELDS,
    ERROR_VERDICT,
    PLATFORM_FIELDS,
    UNSUPPORTED_VERDICT,
    compare_records,
    definition_changes,
    differing_count,
    entry_platform,
    expectation_met_by,
    file_name,
    has_bits,
    is_runner_field,
    numbers,
    platform_id,
    record,
    short,
    side_fields,
    without_bits,
)
from harness.case import checkpoints
from harness.case.registry import CaseError, Registry

BASELINES_DIR = Path(__file__).resolve().parents[2] / "baselines"
SCHEMA = 2
KIND = "bitwise-harness baseline"
RECORD_COMMAND = "python -m harness baseline record --device {device} --tokens {tokens}"
WITHOUT_BITS = ("recorded before records carried each side's bits (2026-12-06): judged by verdict, counts and max ULP "
                "only; record them again on this platform to pin their bits")


class BaselineError(ValueError):
    """An unreadable or malformed baseline file, or a night that cannot become one; the message names the file."""


# --- files ---------------------------------------------------------------------------------------------------

def load_all(directory: Path | None) -> list[dict]:
    """Every baseline file in `directory` (none when it is None or absent); a broken file is an error."""
    if directory is None or not Path(directory).is_dir():
        return []
    return [load(path) for path in sorted(Path(directory).glob("*.json"))]


def load(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise BaselineError(f"{path}: cannot read a baseline: {error}") from None
    if not isinstance(data, dict) or data.get("kind") != KIND or data.get("schema") != SCHEMA:
        found = (data.get("kind"), data.get("schema")) if isinstance(data, dict) else type(data).__name__
        raise BaselineError(f"{path}: field 'kind'/'schema': not a baseline of schema {SCHEMA} (got {found!r}); "
                            "record this platform again with `python -m harness baseline update`")
    for key in ("platform", "runners", "cases"):
        if not isinstance(data.get(key), dict):
            raise BaselineError(f"{path}: field {key!r}: expected an object (got {data.get(key)!r:.80})")
    data["_file"] = str(path)
    return data


def for_platform(baselines: list[dict], print_: dict) -> dict | None:
    return next((b for b in baselines if b["platform"] == print_), None)


def build(night: dict, existing: list[dict]) -> list[tuple[dict, list[dict], dict | None]]:
    """The baselines a night makes, one per platform its cases ran on: ``(baseline, changes, previous)``, each
    keeping `previous` records of cases the night did not run; changes against `previous` are
    ``{"case", "change": added|removed|changed|kept, "details"}``.

    Refuses (BaselineError naming them) a night with any ERROR case (a baseline records known verdicts, never a
    failure to run), and a shard (part of a night: merge the shards first).
    """
    if night.get("shard"):
        raise BaselineError(f"night {night.get('run_id')} is shard {night['shard']['index']}/{night['shard']['count']}"
                            " of a night: merge the shards (`python -m harness nightly-merge`) and record the merge")
    errors = [e["case"] for e in night.get("cases", []) if e.get("verdict") == ERROR_VERDICT]
    if errors:
        raise BaselineError(f"night {night.get('run_id')}: {len(errors)} case(s) ended ERROR: {', '.join(errors)}; "
                            "a baseline records known verdicts, never a failure to run (fix them, run again)")
    groups: dict[str, tuple[dict, list[dict]]] = {}
    for entry in night.get("cases", []):
        print_ = entry_platform(entry, night)
        groups.setdefault(platform_id(print_), (print_, []))[1].append(entry)
    names = {e["case"] for e in night.get("cases", [])}
    return [_build_one(night, print_, entries, names, for_platform(existing, print_))
            for print_, entries in groups.values()]


def _build_one(night: dict, print_: dict, entries: list[dict], names: set[str],
               previous: dict | None) -> tuple[dict, list[dict], dict | None]:
    old = (previous or {}).get("cases", {})
    recorded = ((previous or {}).get("recorded_from") or {}).get("tokens")
    if night.get("select") and previous and recorded != night.get("tokens"):
        raise BaselineError(f"night {night.get('run_id')} ran the cases `-k {night['select']}` picks at tokens "
                            f"{night.get('tokens')}, but {previous.get('_file', previous['name'])} was recorded at "
                            f"tokens {recorded}: one baseline holds one token count")
    runners: dict[str, dict] = {}
    cases, changes = {}, []
    for entry in entries:
        name, now = entry["case"], record(entry)
        if now is None:
            if name in old:
                cases[name] = {**old[name], "runners": [
                    key and _runner_key(runners, key.split(".")[0], previous["runners"][key])
                    for key in old[name].get("runners", [])]}
                changes.append({"case": name, "change": "kept", "details": ["not run in this night"]})
            continue
        case_runners = (entry.get("result") or {}).get("case", {}).get("runners", [])
        now["runners"] = [_runner_key(runners, runner, fields) if fields is not None else None
                          for runner, fields in zip(case_runners, side_fields(entry), strict=False)]
        cases[name] = now
        if name not in old:
            changes.append({"case": name, "change": "added", "details": [_summary(now)]})
        else:
            moved = compare_records(old[name], record(entry, bits=has_bits(old[name]))) \
                if old[name]["definition"] == now["definition"] else \
                ["definition changed: " + "; ".join(definition_changes(old[name]["definition"], now["definition"]))]
            if not moved and has_bits(now) and not has_bits(old[name]):
                moved = ["the same counts, now with each side's bits"]
            if moved:
                changes.append({"case": name, "change": "changed", "details": moved})
    host = night.get("harness") or {}
    recorded_from = {"run_id": night.get("run_id"), "started_at": night.get("started_at"),
                     "tokens": night.get("tokens"), "node": host.get("node"), "harness_version": host.get("version")}
    if night.get("select") and previous:  # a night of the cases -k picked: the others keep their records
        for name in sorted(set(old) - names):
            cases[name] = {**old[name], "runners": [key and _runner_key(runners, key.split(".")[0],
                                                                        previous["runners"][key])
                                                    for key in old[name].get("runners", [])]}
        recorded_from = {**previous["recorded_from"], "updated_from": [
            *previous["recorded_from"].get("updated_from", []),
            {"run_id": night.get("run_id"), "started_at": night.get("started_at"), "select": night["select"]}]}
    else:
        changes += [{"case": name, "change": "removed", "details": [_summary(old[name])]}
                    for name in sorted(old) if name not in names]
    baseline = {"schema": SCHEMA, "kind": KIND, "name": file_name(print_).removesuffix(".json"),
                "platform_id": platform_id(print_), "platform": print_,
                "recorded_from": recorded_from,
                "runners": dict(sorted(runners.items())), "cases": dict(sorted(cases.items()))}
    if without_bits(cases):
        baseline["without_bits"] = {"cases": without_bits(cases), "why": WITHOUT_BITS}
    return baseline, changes, previous


def _runner_key(runners: dict[str, dict], runner: str, fields: dict) -> str:
    """The key of `fields` in the baseline's runners table (``paddle``, ``paddle.2`` ... for distinct sets)."""
    for key, known in runners.items():
        if key.split(".")[0] == runner and known == fields:
            return key
    count = sum(key.split(".")[0] == runner for key in runners)
    key = runner if count == 0 else f"{runner}.{count + 1}"
    runners[key] = fields
    return key


def dumps(baseline: dict) -> str:
    """JSON, one line per tensor and per small object, so a re-recorded file's diff reads case by case."""
    return _dump({k: v for k, v in baseline.items() if not k.startswith("_")}, 0) + "\n"


def _dump(value, depth: int) -> str:
    small = isinstance(value, (dict, list)) and len(value) <= 6 and not any(
        isinstance(v, (dict, list)) and v and not _digests(v) for v in _values(value))
    if not isinstance(value, (dict, list)) or not value or small:
        return json.dumps(value)
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, list):
        return "[\n" + ",\n".join(inner + _dump(v, depth + 1) for v in value) + f"\n{pad}]"
    return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in value.items()) + f"\n{pad}}}"


def _digests(value) -> bool:
    """A differing tensor's two digests (``bits``): kept on its record's line."""
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)


def _values(value):
    return value.values() if isinstance(value, dict) else value


# --- fit: a committed baseline against today's registry and fields ----------------------------------------------

def fit_problems(baseline: dict, registry: Registry) -> list[str]:
    """Why `baseline` no longer fits today's registry or fingerprint fields, or contradicts what a case states
    (empty: it fits). A record that is UNSUPPORTED where the case states a verdict is a platform lacking a kernel,
    not a contradiction. Nothing runs."""
    problems = []
    device = baseline["platform"].get("device")
    wanted = PLATFORM_FIELDS.get(device, ())
    if set(baseline["platform"]) != set(wanted):
        problems.append(f"platform fields {sorted(baseline['platform'])}, expected {list(wanted)}")
    for key, fields in baseline["runners"].items():
        stale = [f for f in fields if not is_runner_field(f)]
        if stale:
            problems.append(f"runners.{key}: fields no longer in the fingerprint: {', '.join(stale)}")
    for name, known in baseline["cases"].items():
        problems += [f"case {name}: {p}" for p in _case_fit(name, known, baseline, registry, device)]
    listed, found = (baseline.get("without_bits") or {}).get("cases", []), without_bits(baseline["cases"])
    if listed != found:
        problems.append(f"field 'without_bits' lists {listed}, but the records without each side's bits are {found}")
    return problems


def _case_fit(name: str, known: dict, baseline: dict, registry: Registry, device: str) -> list[str]:
    try:
        case = registry.get(name)
        if device not in case.devices:
            return [f"no longer lists device {device!r}"]
        tokens = known["definition"].get("tokens")
        today = case_definition(case.with_tokens(tokens) if tokens else case)
    except (CaseError, checkpoints.CheckpointError) as error:
        return [f"not in today's registry as recorded ({error})"]
    recorded = {k: v for k, v in known["definition"].items() if k in today}  # a --weights case: no digest to check
    problems = []
    if recorded != today:
        problems.append("definition changed: " + "; ".join(definition_changes(recorded, today)))
    stated = case.expect
    if stated.stated and known["verdict"] != UNSUPPORTED_VERDICT and not expectation_met_by(
            known, {"verdict": stated.verdict, "differs": stated.differs, "equal": stated.equal,
                    "only_differ": stated.only_differ, "bitwise_steps": stated.bitwise_steps}):
        differing = ", ".join(known["differing"]) or "all equal"
        problems.append(f"states {stated.verdict} (differs {list(stated.differs)}, equal {list(stated.equal)}) but "
                        f"this platform's record is {known['verdict']} ({differing}): a stated expectation holds on "
                        "every platform; fix the case or leave it to the baselines")
    missing = [key for key in known.get("runners", []) if key and key not in baseline["runners"]]
    if missing:
        problems.append(f"refers to runners {missing} the file does not hold")
    return problems


def record_command(device: str, tokens: int | None) -> str:
    """The one command that re-records a platform's baseline (what a failing test tells its reader to run)."""
    return RECORD_COMMAND.format(device=device, tokens=tokens or 16)


SUMMARY_TENSORS = 8  # a change line names this many tensors (a training case differs in thousands)


def _summary(rec: dict) -> str:
    listed = list(rec["differing"].items())
    tensors = "; ".join(f"{name} {numbers(t)}" for name, t in listed[:SUMMARY_TENSORS])
    more = differing_count(rec) - min(len(listed), SUMMARY_TENSORS)
    if more:
        tensors += f" (and {more} more)"
    reason = f": {short(rec['reason'], 120)}" if rec.get("reason") else ""
    return f"{rec['verdict']}{reason}" + (f": {tensors}" if tensors else "")


def case_definition(case) -> dict:
    """The definition a run of `case` records (``records.definition``), computed from the case alone: nothing
    runs. A case whose weights come from a file given at run time (``--weights``) has no digest before it runs."""
    described = asdict(case)
    found = {key: described[key] for key in DEFINITION_FIELDS}
    if not needs_weights_file(case):
        found["checkpoint_digest"] = checkpoints.digest(case)
    return json.loads(json.dumps(found, default=str))


def needs_weights_file(case) -> bool:
    return bool(case.weights_from and not case.weights_from.file and not case.weights_from.package)

