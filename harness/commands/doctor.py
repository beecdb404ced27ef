"""``python -m harness doctor [--device cpu|gpu] [--python RUNNER=PATH] [--json FILE]``: what each runner would
run here.

Each runner is asked in its own subprocess, with its own interpreter and the environment a comparison gives it
(``python -m harness.runners.<name> --probe --device D``, harness.run.protocol): the answer is what that
environment really has (versions, CPU ISA or GPU, which bf16 kernels exist), and per op the implementation it would
run, with, on the Paddle side, each implementation level and why it is unavailable. A runner whose interpreter is
missing or whose framework is not installed is listed as not usable, with the reason; one whose framework (or a Paddle
level) is installed but does not import is listed as BROKEN: its cells would be ERRORs, not skips. It computes
nothing; the nightly records it as ``doctor.json``.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import __version__
from harness.case.registry import RUNNERS
from harness.pipeline import run_folder
from harness.report import doctor_report
from harness.run.orchestrate import REPO_ROOT, runner_env, runner_python
from harness.run.protocol import host_provenance

DOCTOR_SCHEMA = 1
PROBE_TIMEOUT = 600.0
TAIL = 1500


def add_parser(commands) -> None:
    parser = commands.add_parser("doctor", help="which implementation each runner would use here, and why (run "
                                                "first on a new machine)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--python", action="append", default=[], metavar="RUNNER=PATH",
                        help="interpreter for a runner (or set HARNESS_PYTHON_<RUNNER>)")
    parser.add_argument("--json", type=Path, help="also write the answer as JSON to this file")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT, help="seconds per runner's probe")


def main(args, pythons: dict[str, str]) -> int:
    doctor = run(args.device, pythons, args.timeout)
    if args.json:
        args.json.write_text(json.dumps(doctor, indent=2, default=str) + "\n")
    print(doctor_report.markdown(doctor))
    return 0


def run(device: str, pythons: dict[str, str], timeout: float = PROBE_TIMEOUT, runners=RUNNERS) -> dict:
    """Every runner's probe answer, asked concurrently."""
    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        answers = dict(zip(runners, pool.map(lambda r: probe(r, runner_python(r, pythons), device, timeout), runners),
                           strict=True))
    return {"schema": DOCTOR_SCHEMA, "kind": "doctor", "device": device, "created_at": run_folder.now(),
            "harness": {"version": __version__, "host": host_provenance()}, "runners": answers}


def probe(runner: str, python: str, device: str, timeout: float) -> dict:
    """One runner's answer, or ``{"ok": False, "reason": ...}`` saying why it could not answer."""
    command = [python, "-m", f"harness.runners.{runner}", "--probe", "--device", device]
    env = {**runner_env(device), "ONEDNN_VERBOSE": "0"}  # the kernel probes must not print onto the JSON answer
    base = {"runner": runner, "python": python, "command": " ".join(command)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env,
                              stdin=subprocess.DEVNULL)
    except OSError as error:
        return {**base, "ok": False, "reason": f"interpreter {python!r} cannot start: {error}"}
    except subprocess.TimeoutExpired:
        return {**base, "ok": False, "reason": f"the probe did not answer within {timeout:g} s"}
    answer = _last_json(done.stdout)
    if done.returncode != 0 or answer is None:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = last[-1] if last else f"no answer on stdout (exit code {done.returncode})"
        return {**base, "ok": False, "reason": f"the runner does not start in this interpreter: {why}",
                "returncode": done.returncode, "stderr_tail": done.stderr[-TAIL:]}
    if "importable" not in answer and "probe_error" not in answer:  # the runner answered its interpreter only
        return {**base, **answer, "ok": False, "broken": False, "not_probed": True,
                "reason": "not probed: the runner answers no more than its interpreter and host (it has no probe)"}
    ok = answer.get("importable") and not answer.get("broken") and "probe_error" not in answer
    reason = answer.get("reason") or answer.get("probe_error") or ""
    return {**base, **answer, "ok": bool(ok), "broken": bool(answer.get("broken")), "reason": reason}


def _last_json(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None
