"""Known verdicts per platform (baselines): a nightly is green unless something changed.

A *platform fingerprint* is what decides the bits besides the case: the device, for a CPU its model and vector
ISA flags, and per runner the framework and library versions, BLAS/oneDNN builds, torch's CPU capability and
thread count, GPU name, capability, driver, CUDA runtime, cuDNN and cuBLAS(Lt) versions, and the environment
flags that pick kernels (``ONEDNN_*``, ``MKL_*``, ``OMP_*``, ...). It is read from the night's report.json: the
harness's host provenance and every runner's meta.json (the truth oracle is left out: it never decides a
verdict). Library paths are dropped from values (an environment installed elsewhere is the same platform).

A *baseline* is one JSON file per fingerprint under ``baselines/`` (readable name, full fingerprint inside):
per case its verdict, whether it met its own expectation, its definition (checkpoint digest, op, dtype, tp,
tokens, shapes, config, runners, perturbation) and, per tensor that is not bitwise equal, its status,
mismatch count, max ULP, and ±0 / NaN counts.

How a night's case is judged against its platform's baseline (``judge``):

- **match**: same definition, same verdict, and exactly the same set of non-equal tensors with equal status,
  mismatch count, max ULP and ±0 / NaN counts. Outcome: pass (skip when both are UNSUPPORTED).
- **fixed**: the case now meets its own expectation (exit code 0: bitwise equal, or the planted difference of a
  negative control) where the baseline recorded that it did not. Outcome: pass, listed as news.
- **expected**: it meets its own expectation, as in the baseline, but the numbers moved (a negative control or a
  tolerance case whose counts changed). Outcome: pass, as without baselines, listed.
- **changed**: anything else, i.e. it misses its own expectation and differs from the baseline: a new
  difference, a different count or max ULP, a tensor that went back to equal while others still differ, a
  changed verdict, and always an ERROR (a baseline never records one). Outcome: fail, naming the tensors.
- **new**: the baseline has no record of the case, or recorded another definition of it (other tokens, shapes,
  inputs...). Outcome: pass or skip, whatever its verdict, except ERROR, which fails.
- **not run**: the case has no verdict tonight (it needs ``--weights``); its outcome is left alone.

Without a baseline for the night's fingerprint every case keeps today's outcome (its own expectation), and the
report names the nearest baseline and the fingerprint fields that differ: a new framework version, driver or
CPU is exactly when known verdicts must be looked at again, so it never turns green by itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

BASELINES_DIR = Path(__file__).resolve().parents[2] / "baselines"
SCHEMA = 1
KIND = "bitwise-harness baseline"
ERROR_VERDICT, UNSUPPORTED_VERDICT = "ERROR", "UNSUPPORTED"
ORACLE_LABEL = "oracle"

# meta.json fields that can change the bits a runner produces (anything else: per-case or per-run noise).
FINGERPRINT_META = ("framework", "versions", "torch_cpu_capability", "torch_blas", "torch_onednn", "torch_threads",
                    "paddle_with_mkl", "paddle_onednn", "blas", "gpu", "gpu_capability", "gpu_driver",
                    "cuda_runtime", "cudnn", "cublas", "cublasLt", "preferred_blas_library")
KERNEL_ENV_PREFIXES = ("ONEDNN_", "DNNL_", "MKL_", "OMP_", "KMP_", "OPENBLAS_", "NVIDIA_TF32", "CUBLAS_", "FLAGS_")
DEFINITION_FIELDS = ("op", "dtype", "tp", "tokens", "shapes", "config", "runners", "perturb")
TENSOR_FIELDS = ("status", "mismatches", "max_ulp", "signed_zero_diffs", "nan_mismatches", "nan_payload_diffs")
ALWAYS_RECORDED = ("status", "mismatches", "max_ulp")  # the others only when nonzero, to keep files readable
STATUSES = ("changed", "fixed", "new", "expected", "match", "not run")


class BaselineError(ValueError):
    """An unreadable or malformed baseline file, or a night that cannot become one; the message names the file."""


# --- fingerprint ---------------------------------------------------------------------------------------------

def fingerprint(night: dict) -> dict:
    """The platform fingerprint of a nightly report (see the module docstring)."""
    host = (night.get("harness") or {}).get("host") or {}
    device = night.get("device")
    found: dict[str, dict[str, set]] = {}
    for entry in night.get("cases", []):
        for side in (entry.get("result") or {}).get("sides", []):
            if side.get("label") == ORACLE_LABEL or not side.get("meta"):
                continue
            fields = found.setdefault(side["runner"], {})
            meta = side["meta"]
            picked = {key: meta[key] for key in FINGERPRINT_META if key in meta}
            picked["env"] = {k: v for k, v in (meta.get("env") or {}).items() if k.startswith(KERNEL_ENV_PREFIXES)}
            for key, value in flatten(picked):
                fields.setdefault(key, set()).add(_strip_paths(value))
    runners = {runner: {key: " | ".join(sorted(values)) for key, values in sorted(fields.items())}
               for runner, fields in sorted(found.items())}
    platform = {"device": device, "machine": host.get("machine")}
    if device != "gpu":  # on a GPU the kernels are the GPU's; its host CPU only feeds it
        platform.update({"cpu": host.get("cpu"), "cpu_isa": " ".join(host.get("cpu_isa") or [])})
    return {"platform": platform, "runners": runners}


def fingerprint_id(print_: dict) -> str:
    return hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:12]


def file_name(print_: dict) -> str:
    """A readable file name: device, CPU or GPU, ISA level, framework versions, and the fingerprint's id."""
    platform, runners = print_["platform"], print_["runners"]
    gpu = next((fields["gpu"] for fields in runners.values() if fields.get("gpu")), None)
    parts = [platform["device"], _slug(gpu if platform["device"] == "gpu" and gpu else platform.get("cpu") or "")]
    if platform["device"] != "gpu":
        parts.append(_isa_level(platform.get("cpu_isa", "").split()))
    versions = {}
    for fields in runners.values():
        for key, value in fields.items():
            if key.startswith("versions.") and key != "versions.paddle_commit":
                versions.setdefault(key.split(".", 1)[1], value)
    parts += [_slug(f"{name}{value}") for name, value in sorted(versions.items()) if name in _NAMED_VERSIONS]
    return "-".join(p for p in parts if p) + f"-{fingerprint_id(print_)[:8]}.json"


_NAMED_VERSIONS = ("megatron-core", "paddlepaddle", "paddlefleet", "torch")


def differences(before: dict, after: dict) -> list[dict]:
    """Fingerprint fields that differ, flattened (``runners.torch.versions.torch``)."""
    a, b = dict(flatten(before)), dict(flatten(after))
    return [{"field": k, "baseline": a.get(k), "tonight": b.get(k)} for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


# --- records -------------------------------------------------------------------------------------------------

def record(entry: dict) -> dict | None:
    """What a baseline keeps of one night entry; None for a case with no verdict (not run)."""
    if not entry.get("verdict"):
        return None
    result = entry.get("result") or {}
    differing = {}
    for tensor in result.get("tensors", []):
        if tensor.get("status") == "EQUAL":
            continue
        differing[tensor["name"]] = {key: tensor.get(key) for key in TENSOR_FIELDS
                                     if key in ALWAYS_RECORDED or tensor.get(key)}
    return {"verdict": entry["verdict"], "expected": entry.get("expected"),
            "expectation_met": entry.get("exit_code") == 0, "definition": definition(result),
            "differing": dict(sorted(differing.items()))}


def definition(result: dict) -> dict:
    """What makes a case the same case: its inputs (the checkpoint digest covers seed, shapes, tokens and
    distributions) and what runs on them."""
    case = result.get("case") or {}
    found = {key: case.get(key) for key in DEFINITION_FIELDS if key in case}
    digest = (result.get("checkpoint") or {}).get("digest")
    if digest:
        found["checkpoint_digest"] = digest
    return json.loads(json.dumps(found, default=str))  # tuples as lists, as stored


def compare_records(before: dict, after: dict) -> list[str]:
    """How `after` differs from `before` (two records of one case), one phrase each; empty when they match."""
    changes = []
    if before["definition"] != after["definition"]:
        fields = sorted(k for k in set(before["definition"]) | set(after["definition"])
                        if before["definition"].get(k) != after["definition"].get(k))
        changes.append("definition changed (" + ", ".join(
            f"{k}: {_short(before['definition'].get(k))} → {_short(after['definition'].get(k))}" for k in fields) + ")")
    if before["verdict"] != after["verdict"]:
        changes.append(f"verdict {before['verdict']} → {after['verdict']}")
    if {before["verdict"], after["verdict"]} & {ERROR_VERDICT, UNSUPPORTED_VERDICT}:
        return changes  # tensors were not compared on one side: the verdict says it all
    old, new = before["differing"], after["differing"]
    for name in list(new) + [n for n in old if n not in new]:
        if name not in old:
            changes.append(f"{name}: new difference ({_numbers(new[name])})")
        elif name not in new:
            changes.append(f"{name}: now bitwise equal (baseline: {_numbers(old[name])})")
        elif old[name] != new[name]:
            moved = [f"{k.replace('_', ' ')} {old[name].get(k, 0)} → {new[name].get(k, 0)}" for k in TENSOR_FIELDS
                     if old[name].get(k, 0) != new[name].get(k, 0)]
            changes.append(f"{name}: " + ", ".join(moved))
    return changes


# --- judging a night -----------------------------------------------------------------------------------------

def judge_case(entry: dict, known: dict | None) -> dict:
    """One case against its baseline record: status, the outcome it gets, and what changed."""
    own = entry["outcome"]
    now = record(entry)
    if now is None:
        return {"status": "not run", "outcome": own, "changes": []}
    if known is None:
        return {"status": "new", "outcome": _known(own, now), "changes": ["no baseline record of this case"]}
    if now["verdict"] == ERROR_VERDICT:  # never known, whatever else changed (a crash may not even load the case)
        return {"status": "changed", "outcome": "fail", "changes": [f"verdict {known['verdict']} → ERROR"]}
    if known["definition"] != now["definition"]:
        return {"status": "new", "outcome": _known(own, now), "changes": compare_records(known, now)[:1]}
    changes = compare_records(known, now)
    if not changes:
        return {"status": "match", "outcome": _known(own, now), "changes": []}
    if now["expectation_met"]:
        return {"status": "expected" if known["expectation_met"] else "fixed", "outcome": own, "changes": changes}
    return {"status": "changed", "outcome": "fail", "changes": changes}


def judge(night: dict, baselines: list[dict], source: str = "") -> dict:
    """Judge every case of `night` against the baseline of its fingerprint, if one is among `baselines`.

    Returns the night's baseline section (stored in report.json as ``baseline``); the outcomes it assigns are in
    ``cases[i]["outcome"]`` and applied by ``apply``.
    """
    print_ = fingerprint(night)
    ident = fingerprint_id(print_)
    section = {"directory": source, "run_id": night.get("run_id"), "fingerprint_id": ident, "fingerprint": print_,
               "file": None, "suggested_file": file_name(print_), "cases": []}
    baseline = next((b for b in baselines if b["fingerprint"] == print_), None)
    if baseline is None:
        section["status"] = "none"
        nearest = _nearest(print_, [b for b in baselines if b["fingerprint"]["platform"].get("device")
                                    == night.get("device")])
        section["nearest"] = nearest and {"file": nearest["_file"], "differences":
                                          differences(nearest["fingerprint"], print_)}
        return section
    section.update({"status": "applied", "file": baseline["_file"], "recorded_from": baseline.get("recorded_from")})
    for entry in night.get("cases", []):
        verdict = judge_case(entry, baseline["cases"].get(entry["case"]))
        section["cases"].append({"case": entry["case"], "verdict": entry.get("verdict"),
                                 "baseline_verdict": (baseline["cases"].get(entry["case"]) or {}).get("verdict"),
                                 "own_outcome": entry["outcome"], **verdict})
    section["not_in_night"] = sorted(set(baseline["cases"]) - {e["case"] for e in night.get("cases", [])})
    section["counts"] = {status: sum(c["status"] == status for c in section["cases"]) for status in STATUSES}
    return section


def apply(night: dict, baselines: list[dict], source: str = "") -> dict:
    """Judge the night (``judge``) and set each case's outcome from it; a changed case gets its changes as
    problems (they name the tensors), a known difference a note in its message. Returns the section."""
    section = judge(night, baselines, source)
    by_case = {c["case"]: c for c in section["cases"]}
    for entry in night.get("cases", []):
        judged = by_case.get(entry["case"])
        if judged is None:
            continue
        entry["baseline"] = judged["status"]
        entry["outcome"] = judged["outcome"]
        if judged["status"] == "changed":
            entry["problems"] = [*entry.get("problems", []),
                                 *(f"differs from the baseline: {c}" for c in judged["changes"])]
        elif judged["status"] == "match" and judged["own_outcome"] == "fail":
            entry["message"] = f"{entry.get('message', '')} (known: matches the baseline)".strip()
        elif judged["status"] == "new" and judged["own_outcome"] == "fail" and judged["outcome"] != "fail":
            entry["message"] = f"{entry.get('message', '')} (new: no baseline for this case yet)".strip()
    return section


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
        raise BaselineError(f"{path}: field 'kind'/'schema': not a baseline of schema {SCHEMA} (got {found!r})")
    for key, kind in (("fingerprint", dict), ("cases", dict)):
        if not isinstance(data.get(key), kind):
            raise BaselineError(f"{path}: field {key!r}: expected an object (got {data.get(key)!r:.80})")
    data["_file"] = str(path)
    return data


def build(night: dict, previous: dict | None) -> tuple[dict, list[dict]]:
    """The baseline a night makes (keeping `previous` records of cases the night did not run), and the
    changes against `previous`: ``{"case", "change": added|removed|changed|kept, "details"}``.

    Refuses (BaselineError naming them) a night with any ERROR case: a baseline records known verdicts, never
    a failure to run.
    """
    errors = [e["case"] for e in night.get("cases", []) if e.get("verdict") == ERROR_VERDICT]
    if errors:
        raise BaselineError(f"night {night.get('run_id')}: {len(errors)} case(s) ended ERROR: {', '.join(errors)}; "
                            "a baseline records known verdicts, never a failure to run (fix them, run again)")
    print_ = fingerprint(night)
    old = (previous or {}).get("cases", {})
    cases, changes = {}, []
    for entry in night.get("cases", []):
        name, now = entry["case"], record(entry)
        if now is None:
            if name in old:
                cases[name] = old[name]
                changes.append({"case": name, "change": "kept", "details": ["not run in this night"]})
            continue
        cases[name] = now
        if name not in old:
            changes.append({"case": name, "change": "added", "details": [_summary(now)]})
        elif compare_records(old[name], now):
            changes.append({"case": name, "change": "changed", "details": compare_records(old[name], now)})
    run_names = {e["case"] for e in night.get("cases", [])}
    changes += [{"case": name, "change": "removed", "details": [_summary(old[name])]}
                for name in sorted(old) if name not in run_names]
    host = (night.get("harness") or {})
    baseline = {"schema": SCHEMA, "kind": KIND, "name": file_name(print_).removesuffix(".json"),
                "fingerprint_id": fingerprint_id(print_), "fingerprint": print_,
                "recorded_from": {"run_id": night.get("run_id"), "started_at": night.get("started_at"),
                                  "tokens": night.get("tokens"), "node": host.get("node"),
                                  "harness_version": host.get("version")},
                "cases": dict(sorted(cases.items()))}
    return baseline, changes


def dumps(baseline: dict) -> str:
    return json.dumps({k: v for k, v in baseline.items() if not k.startswith("_")}, indent=2, sort_keys=False) + "\n"


# --- helpers -------------------------------------------------------------------------------------------------

def _known(own: str, now: dict) -> str:
    """The outcome of a case the baseline does not fail: its own, except that a miss of its own expectation
    passes (skips, when UNSUPPORTED); an ERROR always fails."""
    if now["verdict"] == ERROR_VERDICT:
        return "fail"
    if own != "fail":
        return own
    return "skip" if now["verdict"] == UNSUPPORTED_VERDICT else "pass"


def _nearest(print_: dict, baselines: list[dict]) -> dict | None:
    return min(baselines, key=lambda b: (len(differences(b["fingerprint"], print_)), b["_file"]), default=None)


def _summary(rec: dict) -> str:
    tensors = "; ".join(f"{name} {_numbers(t)}" for name, t in rec["differing"].items())
    met = "meets its expectation" if rec["expectation_met"] else f"expected {rec.get('expected')}"
    return f"{rec['verdict']} ({met})" + (f": {tensors}" if tensors else "")


def _numbers(tensor: dict) -> str:
    extra = [f"{k.replace('_', ' ')} {tensor[k]}" for k in TENSOR_FIELDS[3:] if tensor.get(k)]
    status = "" if tensor.get("status") == "DIFF" else f"{tensor.get('status')}, "
    return ", ".join([f"{status}{tensor.get('mismatches')} mismatches", f"max ULP {tensor.get('max_ulp')}", *extra])


def _short(value, limit: int = 60) -> str:
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


def _isa_level(flags: list[str]) -> str:
    if any(f.startswith("amx") for f in flags):
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "noavx"
