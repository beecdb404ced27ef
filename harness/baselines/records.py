"""Known verdicts per platform (baselines): a known platform difference passes; nothing turns a failure green.

A CPU without a kernel, or two BLAS builds, make the same cases differ every night for the same platform reasons.
A *baseline* is one JSON file per platform under ``baselines/``: per case, the verdict and the numbers a real night
measured there, and what ran. A night's case that repeats its record exactly passes; anything else is judged as
below, and a case the record does not cover is judged by its own expectation, never waved through.

**Which baseline: the platform** (``platform``), the fields that decide which kernels can run at all:

- ``device`` (cpu, gpu): another set of kernels altogether;
- ``machine`` (x86_64, aarch64): another instruction set;
- ``cpu``, the model name: it names the vendor, and MKL takes other code paths on a CPU that is not Intel's;
- ``cpu_isa``, the vector-ISA flags (AVX2, AVX-512 BF16, AMX): oneDNN and MKL pick their kernels by them;
- on a GPU, ``gpu`` (its model) instead of the three CPU fields: the kernels are the GPU's, its host only feeds it.

Each night entry carries the platform it ran on (``entry["platform"]``; the shards of one night may run on
different hosts), and is judged against that platform's baseline.

**What ran, per side** (``runner_fields``): the fields of the runner's meta.json that change bits, compared with
the record's, so a runner missing or changed tonight is named on each case it touches:

- ``framework``, ``versions.*``: which code computed (the framework, Megatron-Core, Paddle and its commit,
  PaddleFormers, transformers, Transformer Engine: whatever the runner reports);
- ``torch``: the torch under Megatron-Core (its kernels);
- ``torch_cpu_capability``: ATen's vector dispatch level (its elementwise and reduction kernels);
- ``torch_blas``, ``torch_onednn``, ``paddle_with_mkl``, ``paddle_onednn``: the BLAS and oneDNN builds (GEMMs);
- ``torch_threads`` and ``env.OMP_NUM_THREADS`` / ``env.MKL_NUM_THREADS``: oneDNN and MKL may split a reduction
  across threads. The harness pins them (harness.run.orchestrate.RUNNER_THREADS), so ``--workers`` and the
  machine's core count do not move them; a user's own setting is recorded as set;
- ``paddle_level``: which Paddle implementation computed (PaddleFleet's module, PaddleFormers', the recipe);
- ``gpu``, ``gpu_capability``, ``gpu_driver``, ``cuda_runtime``, ``cudnn``, ``cublas``, ``cublasLt``,
  ``preferred_blas_library``: the GPU's kernels and the libraries that pick them;
- ``env.*``, the environment variables that pick kernels or numerics (``KERNEL_ENV``): oneDNN's and MKL's ISA
  and reproducibility switches, OpenBLAS's core type, cuBLAS's workspace, TF32 overrides, Transformer Engine's
  backends (``NVTE_*``), NCCL's algorithm and protocol (the order of a TP all-reduce), Paddle's ``FLAGS_*``,
  ``TORCHDYNAMO_DISABLE`` (compiled or eager numerics). Logging switches (``*_VERBOSE``) are left out.

Library paths are dropped from values: an environment installed elsewhere computes the same bits.

**A record** (``record``): the case's verdict, for UNSUPPORTED its reason (normalised: no paths, pids or
addresses), its definition (checkpoint digest, op, dtype, tp, tokens, shapes, config, runners, perturbation), the
runner fields of each side (by reference into the file's ``runners`` table), and per tensor that is not bitwise
equal its status, mismatch count, max ULP and ±0 / NaN counts. Counts do not pin bits (a tensor can move and keep its
mismatch count and max ULP), so a record also keeps each side's bits: per differing tensor ``bits``, the two sides'
digests of its raw bytes (``harness.compare.tensors``: XXH3-128), and ``equal_bits``, the sha256 of the bitwise-equal
tensors' names and digests (one digest each: both sides hold the same bytes). A record without ``equal_bits`` (one
made before records carried bits; the file lists them under ``without_bits``) is judged by its counts alone, as then.

**How a night's case is judged** (``judge_case``), first rule that applies:

| status | when | outcome |
|---|---|---|
| ``no baseline`` | no baseline for its platform | its own expectation |
| ``new`` | no record of it | its own expectation |
| ``lost`` | the record ran it; tonight it is UNSUPPORTED or not run | fail |
| ``not run`` | not run tonight (it needs ``--weights``), nothing recorded running | as it is (skip) |
| ``changed`` | ERROR | fail |
| ``redefined`` | the record is of another definition (tokens, inputs, config ...) | its own expectation |
| ``runner changed`` | a side's runner fields differ from the record's (named) | its own expectation |
| ``match`` | same verdict and UNSUPPORTED reason; the same tensors differ, same numbers, same bits | pass (skip) |
| ``within tolerance`` | a stated tolerance holds tonight; same verdict and tensors, numbers moved | pass, listed |
| ``fixed`` | otherwise, and now it meets its own expectation where the record did not | fail (record again) |
| ``changed`` | anything else, a met expectation included: the record pins numbers and bits | fail, named |

"Its own expectation" is the outcome without baselines: pass when met, skip when UNSUPPORTED, else fail. A met
expectation never passes a case whose numbers moved from its record: an expectation names a few tensors, the record
pins every differing tensor's figures and the verdict's reason (a control whose planted bit now reaches further, a
known difference grown by 8192 ULP, an UNSUPPORTED with another reason all met their expectations). A failed
case gets a kind (``failure_kind``) so the report puts apart ERRORs, unmet expectations, changes against the
baseline, cases the baseline ran and tonight did not, and differences nothing states: "differs, no baseline"
(accepted with ``python -m harness baseline update``).
"""

from __future__ import annotations

import hashlib
import json
import re

from harness.compare.expectation import exactness_problems, step_of

ERROR_VERDICT, UNSUPPORTED_VERDICT, DIFF_VERDICT = "ERROR", "UNSUPPORTED", "DIFF"
SIDES = ("a", "b")  # the framework sides; the truth oracle and repeats never decide a verdict

PLATFORM_FIELDS = {"cpu": ("device", "machine", "cpu", "cpu_isa"), "gpu": ("device", "gpu")}
RUNNER_META = ("framework", "versions", "torch", "torch_cpu_capability", "torch_blas", "torch_onednn",
               "torch_threads", "paddle_with_mkl", "paddle_onednn", "paddle_level", "gpu", "gpu_capability",
               "gpu_driver", "cuda_runtime", "cudnn", "cublas", "cublasLt", "preferred_blas_library")
KERNEL_ENV = ("OMP_NUM_THREADS", "MKL_", "ONEDNN_", "DNNL_", "OPENBLAS_", "KMP_DETERMINISTIC_REDUCTION", "CUBLAS_",
              "CUBLASLT_", "NVIDIA_TF32", "NVTE_", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "FLAGS_",
              "TORCHDYNAMO_DISABLE")
DEFINITION_FIELDS = ("op", "dtype", "tp", "tokens", "shapes", "config", "runners", "perturb")
TENSOR_FIELDS = ("status", "mismatches", "max_ulp", "signed_zero_diffs", "nan_mismatches", "nan_payload_diffs")
ALWAYS_RECORDED = ("status", "mismatches", "max_ulp")  # the others only when nonzero, to keep files readable
# A record lists at most this many differing tensors, earliest training step first, and the count and sha256 of all
# of them: a 100-step training case differs in 244,749 (29 MB of JSON); a negative control's 1,154 stay listed.
KEPT_DIFFERING = 1500
STEP = re.compile(r"step(\d+)\.")
STATUSES = ("changed", "lost", "fixed", "new", "redefined", "runner changed", "no baseline", "within tolerance",
            "match", "not run")
FAILURE_KINDS = {  # how the report names each kind of failed case, in the order it lists them
    "error": "ERROR", "unmet": "unmet expectation", "changed": "changed against the baseline",
    "lost": "ran in the baseline, not tonight", "unknown": "differs, no baseline",
}


# --- platform and runner fields ------------------------------------------------------------------------------

def platform(host: dict, device: str, sides: list[dict] = ()) -> dict:
    """The platform a case ran on: from the host that ran its runners and, on a GPU, the GPU a side reported."""
    if device == "gpu":
        return {"device": "gpu", "gpu": next(((s.get("meta") or {}).get("gpu") for s in sides
                                              if (s.get("meta") or {}).get("gpu")), None)}
    return {"device": device, "machine": host.get("machine"), "cpu": host.get("cpu"),
            "cpu_isa": " ".join(host.get("cpu_isa") or [])}


def platform_id(print_: dict) -> str:
    return hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:12]


def entry_platform(entry: dict, night: dict) -> dict:
    """The platform stored with a night entry; a night written before entries carried one: the night's host."""
    return entry.get("platform") or platform((night.get("harness") or {}).get("host") or {}, night.get("device"),
                                             (entry.get("result") or {}).get("sides", []))


def runner_fields(meta: dict) -> dict[str, str]:
    """The fields of one side's meta.json that change bits (module docstring), flattened, paths dropped."""
    picked = {key: meta[key] for key in RUNNER_META if key in meta}
    picked["env"] = {k: v for k, v in (meta.get("env") or {}).items()
                     if k.startswith(KERNEL_ENV) and not k.endswith("_VERBOSE")}
    return {key: _strip_paths(value) for key, value in sorted(flatten(picked))}


def is_runner_field(key: str) -> bool:
    """Whether `key` is a field ``runner_fields`` can produce (a baseline holding others no longer fits)."""
    head = key.split(".", 1)[0]
    if head == "env":
        name = key.split(".", 1)[1] if "." in key else ""
        return name.startswith(KERNEL_ENV) and not name.endswith("_VERBOSE")
    return head in RUNNER_META and (head == "versions" or "." not in key)


def side_fields(entry: dict) -> list[dict[str, str] | None]:
    """Runner fields of sides a and b of a night entry (None for a side that wrote no meta.json)."""
    by_label = {s.get("label"): s for s in (entry.get("result") or {}).get("sides", [])}
    return [runner_fields(by_label[label]["meta"]) if (by_label.get(label) or {}).get("meta") else None
            for label in SIDES]


def file_name(print_: dict) -> str:
    """A readable file name: device, CPU model or GPU, ISA level, and the platform's id."""
    if print_["device"] == "gpu":
        parts = ["gpu", _slug(print_.get("gpu") or "unknown")]
    else:
        parts = [print_["device"], _slug(print_.get("cpu") or ""), isa_level(print_.get("cpu_isa") or "")]
    return "-".join(p for p in parts if p) + f"-{platform_id(print_)[:8]}.json"


def differences(before: dict, after: dict) -> list[dict]:
    """Fields that differ between two flat or nested dicts (``cpu_isa``, ``versions.torch``)."""
    a, b = dict(flatten(before)), dict(flatten(after))
    return [{"field": k, "baseline": a.get(k), "tonight": b.get(k)} for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


# --- records -------------------------------------------------------------------------------------------------

def record(entry: dict, bits: bool = True) -> dict | None:
    """What a baseline keeps of one night entry (runner fields aside); None for a case with no verdict. `bits`
    False: without each side's bits, as a record made before records carried them (what such a record is judged
    against)."""
    if not entry.get("verdict"):
        return None
    result = entry.get("result") or {}
    differing, equal = {}, {}
    for tensor in result.get("tensors", []):
        digests = tensor.get("digests") if bits else None
        if tensor.get("status") == "EQUAL":
            if digests:
                equal[tensor["name"]] = digests[0]
            continue
        differing[tensor["name"]] = {key: tensor.get(key) for key in TENSOR_FIELDS
                                     if key in ALWAYS_RECORDED or tensor.get(key)}
        if digests:
            differing[tensor["name"]]["bits"] = list(digests)
    found = {"verdict": entry["verdict"], "definition": definition(result)}
    if entry["verdict"] == UNSUPPORTED_VERDICT:
        found["reason"] = normalise_reason(result.get("message") or entry.get("message") or "")
    if bits and any(tensor.get("digests") for tensor in result.get("tensors", [])):
        found["equal_bits"] = hashlib.sha256(json.dumps(equal, sort_keys=True).encode()).hexdigest()
    ordered = sorted(differing.items(), key=lambda item: _in_time(item[0]))
    found["differing"] = dict(ordered[:KEPT_DIFFERING])
    if len(ordered) > KEPT_DIFFERING:
        found["differing_all"] = {"count": len(ordered), "sha256": hashlib.sha256(
            json.dumps(dict(sorted(differing.items())), sort_keys=True).encode()).hexdigest()}
    return found


def _in_time(name: str) -> tuple[int, str]:
    """A tensor's place in a record: by training step (step2 before step10), then by name."""
    step = STEP.match(name)
    return (int(step.group(1)) if step else 0, name)


def has_bits(rec: dict) -> bool:
    """Whether a record pins each side's bits (made since records carry them), not only the counts."""
    return "equal_bits" in rec


def without_bits(cases: dict[str, dict]) -> list[str]:
    """The records of compared tensors that pin counts only (what a baseline file lists under ``without_bits``)."""
    return sorted(name for name, rec in cases.items()
                  if rec["verdict"] not in (ERROR_VERDICT, UNSUPPORTED_VERDICT) and not has_bits(rec))


def differing_count(rec: dict) -> int:
    """How many tensors a record's run saw differ, the unlisted ones of a long record included."""
    return (rec.get("differing_all") or {}).get("count", len(rec["differing"]))


def definition(result: dict) -> dict:
    """What makes a case the same case: its inputs (the checkpoint digest covers seed, shapes, tokens and
    distributions) and what runs on them."""
    case = result.get("case") or {}
    found = {key: case.get(key) for key in DEFINITION_FIELDS if key in case}
    digest = (result.get("checkpoint") or {}).get("digest")
    if digest:
        found["checkpoint_digest"] = digest
    return json.loads(json.dumps(found, default=str))  # tuples as lists, as stored


def normalise_reason(text: str) -> str:
    """An UNSUPPORTED reason without what differs from machine to machine and run to run: paths, pids, addresses."""
    text = re.sub(r"(?<![\w.])/[^\s:;,'\")\]]+", "<path>", text)
    text = re.sub(r"\b0x[0-9a-fA-F]+\b", "<address>", text)
    return re.sub(r"\b(pid|PID|process)\s+\d+", r"\1 <pid>", text)


def compare_records(before: dict, after: dict) -> list[str]:
    """How `after` differs from `before` (two records of one definition), one phrase each; empty when they match."""
    return [phrase for _, phrase in record_changes(before, after)]


def record_changes(before: dict, after: dict) -> list[tuple[str, str]]:
    """(kind, phrase) per change: kind "verdict", "reason", "set" (another set of differing tensors) or "numbers"
    (a tensor that differs in both, with other figures): a stated tolerance may let only "numbers" through."""
    changes = []
    if before["verdict"] != after["verdict"]:
        changes.append(("verdict", f"verdict {before['verdict']} → {after['verdict']}"))
    elif before.get("reason") != after.get("reason"):
        changes.append(("reason", f"another reason: {short(before.get('reason'), 200)} → "
                                  f"{short(after.get('reason'), 200)}"))
    if {before["verdict"], after["verdict"]} & {ERROR_VERDICT, UNSUPPORTED_VERDICT}:
        return changes  # tensors were not compared on one side: the verdict says it all
    old, new = before["differing"], after["differing"]
    if has_bits(before) and not has_bits(after):
        changes.append(("bits", "the record pins each side's bits; tonight's run has no digests to check them"))
        old = {name: {k: v for k, v in t.items() if k != "bits"} for name, t in old.items()}
    if before.get("differing_all") or after.get("differing_all"):  # a long record lists only its first tensors
        if before.get("differing_all") == after.get("differing_all") and old == new:
            return changes + _equal_bits_change(before, after)
        if before.get("differing_all") != after.get("differing_all"):
            changes.append(("set", f"the differing tensors changed: {differing_count(before)} in the baseline "
                                   f"(sha256 {(before.get('differing_all') or {}).get('sha256', 'of its list')[:12]})"
                                   f", {differing_count(after)} tonight"))
        old = {name: t for name, t in old.items() if name in new}
        new = {name: t for name, t in new.items() if name in old}
    for name in list(new) + [n for n in old if n not in new]:
        if name not in old:
            changes.append(("set", f"{name}: new difference ({numbers(new[name])})"))
        elif name not in new:
            changes.append(("set", f"{name}: now bitwise equal (baseline: {numbers(old[name])})"))
        elif old[name] != new[name]:
            moved = [f"{k.replace('_', ' ')} {old[name].get(k, 0)} → {new[name].get(k, 0)}" for k in TENSOR_FIELDS
                     if old[name].get(k, 0) != new[name].get(k, 0)]
            moved += _bits_moved(old[name].get("bits"), new[name].get("bits"))
            changes.append(("set" if old[name].get("status") != new[name].get("status") else "numbers",
                            f"{name}: " + ", ".join(moved)))
    return changes + _equal_bits_change(before, after, changes)


def _bits_moved(before: list[str] | None, after: list[str] | None) -> list[str]:
    """Which side's bits of a differing tensor moved (its counts may not have): empty for a record without bits."""
    if not before or before == after:
        return []
    moved = [label for label, old, new in zip(SIDES, before, after or [None, None], strict=True) if old != new]
    return [f"other bits on side {' and '.join(moved)} ({', '.join(SIDES)}: {short(before)} → {short(after)})"]


def _equal_bits_change(before: dict, after: dict, changes: list = ()) -> list[tuple[str, str]]:
    """The bitwise-equal tensors now hold other bits (both sides alike), where the set of differing tensors is the
    record's (another set changes the equal ones' digest anyway, and is named already)."""
    if not has_bits(before) or not has_bits(after) or before["equal_bits"] == after["equal_bits"] or any(
            kind == "set" for kind, _ in changes):
        return []
    return [("bits", f"the bitwise-equal tensors hold other bits on both sides (sha256 "
                     f"{before['equal_bits'][:12]} → {after['equal_bits'][:12]})")]


def definition_changes(before: dict, after: dict) -> list[str]:
    fields = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return [f"{k}: {short(before.get(k))} → {short(after.get(k))}" for k in fields]


def runner_changes(entry: dict, known: dict, baseline: dict) -> list[str]:
    """Each side's runner fields tonight against the record's, one phrase per changed field, naming the runner."""
    changes = []
    runners = (entry.get("result") or {}).get("case", {}).get("runners") or known["definition"].get("runners", [])
    for label, runner, now, key in zip(SIDES, runners, side_fields(entry), known.get("runners", [None, None]),
                                       strict=False):
        before = baseline["runners"].get(key) if key else None
        if before is None and now is None:
            continue
        if now is None:
            changes.append(f"side {label} ({runner}): no meta.json tonight (the runner did not start or crashed)")
            continue
        for d in differences(before or {}, now):
            changes.append(f"side {label} ({runner}) {d['field']}: {d['baseline'] or '(absent)'} → "
                           f"{d['tonight'] or '(absent)'}")
    return changes


def record_problems(entry: dict, baseline: dict) -> list[str]:
    """How a run of a case differs from its record in `baseline` (definition, runner fields, verdict, reason,
    tensors), one phrase each: empty when it repeats the record exactly. What an end-to-end test pins."""
    known = baseline["cases"][entry["case"]]
    now = record(entry, bits=has_bits(known))
    if now is None:
        return [f"not run: {entry.get('message', '')}"]
    if known["definition"] != now["definition"]:
        return ["definition changed: " + "; ".join(definition_changes(known["definition"], now["definition"]))]
    return runner_changes(entry, known, baseline) + compare_records(known, now)


def expectation_met_by(known: dict, expectation: dict) -> bool:
    """Whether a record meets an expectation (``harness.compare.result.check_expectation``'s rules)."""
    verdict, wanted = known["verdict"], expectation.get("verdict")
    if verdict != wanted and not (wanted == "WITHIN_TOLERANCE" and verdict == "BITWISE_PASS"):
        return False
    differing = {name for name, t in known["differing"].items() if t.get("status") == DIFF_VERDICT}
    only, steps = expectation.get("only_differ"), list(expectation.get("bitwise_steps") or [])
    if known.get("differing_all") and known["differing"]:  # past its last listed tensor a long record cannot say
        last = _in_time(list(known["differing"])[-1])
        named = [*expectation.get("differs", []), *expectation.get("equal", []), *(only or [])]
        whole = [*steps, *(step_of(name) for name in only or [])]  # steps it must know every tensor of
        if any(_in_time(name) > last for name in named) or any(step is None or step >= last[0] for step in whole):
            return False
    return (all(name in differing for name in expectation.get("differs", []))
            and not any(name in known["differing"] for name in expectation.get("equal", []))
            and not exactness_problems(only, steps, {n: t.get("status") for n, t in known["differing"].items()}))


# --- judging a night -----------------------------------------------------------------------------------------

def judge_case(entry: dict, baseline: dict | None) -> dict:
    """One case against its platform's baseline: status, outcome and what changed (module docstring's table)."""
    own = entry["outcome"]
    if baseline is None:
        return {"status": "no baseline", "outcome": own, "changes": []}
    known = baseline["cases"].get(entry["case"])
    now = record(entry, bits=known is None or has_bits(known))
    ran_before = known is not None and known["verdict"] != UNSUPPORTED_VERDICT
    if known is None:
        return {"status": "not run" if now is None else "new", "outcome": own, "changes": []}
    if now is None:
        if ran_before:
            return {"status": "lost", "outcome": "fail", "changes": [
                f"the baseline ran it ({known['verdict']}); tonight it did not run: {entry.get('message', '')}"]}
        return {"status": "not run", "outcome": own, "changes": []}
    if now["verdict"] == ERROR_VERDICT:  # never known, whatever else changed (a crash may not even load the case)
        return {"status": "changed", "outcome": "fail", "changes": [f"verdict {known['verdict']} → ERROR"]}
    if known["definition"] != now["definition"]:
        return {"status": "redefined", "outcome": own,
                "changes": ["definition changed: " + "; ".join(definition_changes(known["definition"],
                                                                                  now["definition"]))]}
    if ran_before and now["verdict"] == UNSUPPORTED_VERDICT:
        return {"status": "lost", "outcome": "fail", "changes": [
            f"the baseline ran it ({known['verdict']}); tonight UNSUPPORTED: {short(now.get('reason'), 300)}"]}
    moved = runner_changes(entry, known, baseline)
    kinds = record_changes(known, now)
    changes = [phrase for _, phrase in kinds]
    if moved:
        same = ["tonight's numbers equal the record's"] if not changes else []
        return {"status": "runner changed", "outcome": own, "changes": moved + same}
    if not changes:
        return {"status": "match", "outcome": "skip" if now["verdict"] == UNSUPPORTED_VERDICT else "pass",
                "changes": []}
    result = entry.get("result") or {}
    stated = (result.get("case") or {}).get("tolerance")
    if stated and (result.get("tolerance") or {}).get("within") and {kind for kind, _ in kinds} == {"numbers"}:
        return {"status": "within tolerance", "outcome": own, "changes": changes}
    expectation = result.get("expectation") or {}
    if entry.get("exit_code") == 0 and not expectation_met_by(known, expectation):
        return {"status": "fixed", "outcome": "fail", "changes": [
            "it now meets its expectation, which the recorded run did not: look, then record it again "
            "(`python -m harness baseline update`)", *changes]}
    return {"status": "changed", "outcome": "fail", "changes": changes}


def failure_kind(entry: dict) -> str | None:
    """Why a failed case failed (FAILURE_KINDS), None when it did not fail."""
    if entry["outcome"] != "fail":
        return None
    if entry.get("verdict") == ERROR_VERDICT:
        return "error"
    status = entry.get("baseline")
    if status in ("changed", "lost", "fixed"):
        return "changed" if status == "fixed" else status
    stated = ((entry.get("result") or {}).get("expectation") or {}).get("stated")
    return "unknown" if entry.get("verdict") == DIFF_VERDICT and not stated else "unmet"


def judge(night: dict, baselines: list[dict], source: str = "") -> dict:
    """Judge every case of `night` against the baseline of its platform, if `baselines` has one.

    Returns the night's baseline section (stored in report.json as ``baseline``): per platform seen, the file
    applied (or none, with the nearest and what differs), and per case its status, outcome and changes.
    """
    by_platform = {platform_id(b["platform"]): b for b in baselines}
    section = {"directory": source, "run_id": night.get("run_id"), "platforms": [], "cases": []}
    seen: dict[str, dict] = {}
    for entry in night.get("cases", []):
        print_ = entry_platform(entry, night)
        ident = platform_id(print_)
        if ident not in seen:
            seen[ident] = _platform_section(print_, by_platform.get(ident), baselines)
            section["platforms"].append(seen[ident])
        seen[ident]["cases"].append(entry["case"])
        known = by_platform.get(ident)
        verdict = judge_case(entry, known)
        section["cases"].append({"case": entry["case"], "verdict": entry.get("verdict"), "platform": ident,
                                 "baseline_verdict": ((known or {}).get("cases", {}).get(entry["case"]) or {})
                                 .get("verdict"), "own_outcome": entry["outcome"], **verdict})
    names = {e["case"] for e in night.get("cases", [])}
    for part in section["platforms"]:
        applied = by_platform.get(part["platform_id"])
        part["not_in_night"] = sorted(set(applied["cases"]) - names) if applied else []
    applied = [p for p in section["platforms"] if p["file"]]
    section["status"] = ("applied" if len(applied) == len(section["platforms"]) and applied else
                         "partial" if applied else "none")
    section["counts"] = {status: sum(c["status"] == status for c in section["cases"]) for status in STATUSES}
    return section


def apply(night: dict, baselines: list[dict], source: str = "") -> dict:
    """Judge the night (``judge``), set each case's outcome and failure kind from it, and return the section.

    A changed or lost case gets its changes as problems (they name the tensors or the runner); a known difference
    a note in its message.
    """
    section = judge(night, baselines, source)
    by_case = {c["case"]: c for c in section["cases"]}
    for entry in night.get("cases", []):
        judged = by_case[entry["case"]]
        entry["baseline"] = judged["status"]
        entry["outcome"] = judged["outcome"]
        if judged["status"] in ("changed", "lost", "fixed"):
            entry["problems"] = [*entry.get("problems", []),
                                 *(f"differs from the baseline: {c}" for c in judged["changes"])]
        elif judged["status"] == "match" and judged["own_outcome"] == "fail":
            entry["message"] = f"{entry.get('message', '')} (known: matches the baseline)".strip()
        elif judged["status"] in ("redefined", "runner changed") and entry["outcome"] == "fail":
            entry["problems"] = [*entry.get("problems", []),
                                 *(f"the baseline's record does not apply: {c}" for c in judged["changes"])]
    return section


def _platform_section(print_: dict, applied: dict | None, baselines: list[dict]) -> dict:
    part = {"platform": print_, "platform_id": platform_id(print_), "file": None, "suggested_file": file_name(print_),
            "cases": []}
    if applied:
        part.update({"file": applied["_file"], "recorded_from": applied.get("recorded_from")})
        return part
    same_device = [b for b in baselines if b["platform"].get("device") == print_.get("device")]
    nearest = min(same_device, key=lambda b: (len(differences(b["platform"], print_)), b["_file"]), default=None)
    part["nearest"] = nearest and {"file": nearest["_file"], "differences": differences(nearest["platform"], print_)}
    return part


# --- helpers -------------------------------------------------------------------------------------------------

def numbers(tensor: dict) -> str:
    extra = [f"{k.replace('_', ' ')} {tensor[k]}" for k in TENSOR_FIELDS[3:] if tensor.get(k)]
    status = "" if tensor.get("status") == "DIFF" else f"{tensor.get('status')}, "
    return ", ".join([f"{status}{tensor.get('mismatches')} mismatches", f"max ULP {tensor.get('max_ulp')}", *extra])


def short(value, limit: int = 60) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


def flatten(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from flatten(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        yield prefix, " ".join(map(str, value))
    else:
        yield prefix, value


def _strip_paths(value):
    """``12.8.4 (/usr/lib/x/libcublas.so.12)`` -> ``12.8.4``: where a library was installed is not the platform."""
    return re.sub(r"\s*\(/[^)]*\)", "", value) if isinstance(value, str) else json.dumps(value)


def _slug(text: str, limit: int = 40) -> str:
    text = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|@.*$", "", str(text), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")[:limit].strip("-.")


def isa_level(cpu_isa: str) -> str:
    """The vector-ISA level a CPU's flags give (``amx``, ``avx512bf16``, ``avx512``, ``avx2``, ``noavx``)."""
    flags = cpu_isa.split()
    if any(f.startswith("amx") for f in flags):
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "noavx"
