"""``make bench`` (second half): end-to-end speed ratios, each measured side by side in one run (issues 15, 23).

Wall seconds on a shared machine mostly measure the neighbours, so every number here is a *ratio* of two
things measured in the same run, one right after the other, on the same checkpoint:

1. ``compare / floor``: ``python -m harness compare kimi_shared_fc1 --tokens 256`` (oracle on: the plain
   command) against the bare sequential floor, each framework's runner process started alone, one after the
   other (interpreter start, framework import, fc1 forward + backward once, outputs written). Goal <= 0.8:
   the sides overlap and the oracle stays off the critical path.
2. ``oracle / slower side``: the oracle runner alone against the slower framework runner alone. Goal <= 0.5.
3. ``sweep cell / framework work``: an 8-token-count sweep of fc1 on the CPU (``--no-oracle``, as issue 23 measured
   it), wall per cell against the cell's framework work (the slower framework side's own phases from its
   meta.json: setup, forward, backward, write; no interpreter start or import). Goal <= 1.5. The same sweep with
   the oracle on is measured beside it (no goal: the oracle's exact float64 GEMMs are a third runner's work).
4. ``model: compare / floor``: ``python -m harness compare kimi_k2_2layer --tokens 64`` (its float64 truth on)
   against its two sides' runner processes alone, one after the other, less their write phases (each stack's
   interpreter, imports, model build, weights loaded, one forward + backward). Goal <= 1.2.

``--before DIR`` measures another tree too (e.g. today's main: ``git archive main | tar -x -C DIR``), each
measurement of the two trees one right after the other, and prints both columns: before and after in one run.

Everything runs as subprocesses of ``--repo`` (default: this checkout) and ``--before``.

5. ``train: compare / bare floor``: a training case (``--train-case``, default ``kimi_k2_2layer_train_100``: 100
   steps), ``python -m harness compare CASE --runners A,B --no-oracle`` (``--train-runners``) against the stacks' bare
   training loops, each runner process alone on the same checkpoint with ``train.bare`` (its framework's training
   calls only: no state read back, nothing observed or written), one after the other. Goal <= 1.2 (as the model
   level). Beside it, per side, ``dumps: steps / bare steps`` (the side's step phases inside the compare over its bare
   loop's: what canonical names, digests and step files cost). ``--skip-train`` leaves it out (about 7 minutes a
   tree on 2 cores).

``--catalogue DEVICE --catalogue-tokens LIST`` times instead every op-level case of DEVICE swept over LIST (the
whole GPU catalogue at 11 token counts on one H200: goal under 5 minutes), as ``python -m harness compare CASE
--device DEVICE --tokens LIST`` would run each, one case after another (``--catalogue-jobs N``: N cases at once,
sharing the GPU as ``nightly --workers N --cells-per-gpu N`` does), in one pool of runner workers; whole-model
cases are left out (each is a model run per cell, with commands of its own), and so are cases of more GPUs than
are visible. Runner outputs are deleted after each cell and a case's inputs after the case (reports kept):
full-size cases write GBs per cell. Per case it prints where the time went (checkpoints, each side's phases, the
harness's rest), and ``--json`` keeps it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.commands.nightly_shards import positive

REPO = Path(__file__).resolve().parents[2]
CASE = "kimi_shared_fc1"
MODEL_CASE, MODEL_TOKENS = "kimi_k2_2layer", 64
TRAIN_CASE = "kimi_k2_2layer_train_100"
GOALS = {"compare / floor": 0.8, "oracle / slower side": 0.5, "sweep cell / framework work": 1.5,
         "sweep cell / framework work, oracle on": None, "model: compare / floor": 1.2,
         "train: compare / bare floor": 1.2, "train: a: dumps: steps / bare steps": None,
         "train: b: dumps: steps / bare steps": None, "cpu: compare / floor": None, "cpu: oracle / slower side": None}


def env_for(repo: Path) -> dict[str, str]:
    """What the harness gives its runners (orchestrate.runner_env, CPU), so the floor runs like a side does."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("ONEDNN_VERBOSE", "1")
    env.setdefault("TRITON_CACHE_DIR", str(repo / "checkpoints" / ".triton"))  # as orchestrate.GPU_ENV
    return env


CPU_SECONDS: dict[int, float] = {}  # id(CompletedProcess) -> CPU seconds of the command and its children


def timed(command: list[str], repo: Path, **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of the command; its CPU seconds (user + system, all descendants) go to cpu_of(done)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=repo, env=env_for(repo), capture_output=True, text=True, **kwargs)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_SECONDS[id(done)] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return seconds, done


def report_of(reports: Path, done: subprocess.CompletedProcess) -> dict:
    """The report.json a compare or sweep wrote under `reports`; else an error with the command's stderr tail."""
    found = next(reports.glob("*/report.json"), None)
    if found is None:
        raise RuntimeError(f"{' '.join(map(str, done.args))} exited {done.returncode} without a report in {reports}: "
                           f"{done.stderr[-2000:]}")
    return json.loads(found.read_text())


def cpu_of(done: subprocess.CompletedProcess) -> float:
    return CPU_SECONDS.get(id(done), float("nan"))


def prepare_checkpoint(repo: Path, python: str, tokens: int | None, case: str = CASE) -> dict:
    """The case's request fields (at `tokens`, or its own count) and checkpoint files, from the repository under test
    (a tree from before the weights had a part of their own names one file)."""
    code = ("import json, sys\nfrom harness.case.registry import Registry\nfrom harness.case import checkpoints\n"
            f"case = Registry.load().get({case!r})\n"
            + (f"case = case.with_tokens({tokens})\n" if tokens else "") +
            "ck = checkpoints.prepare(case)\n"
            "files = [str(f) for f in ck.files] if hasattr(ck, 'files') else str(ck.path)\n"
            "print(json.dumps({'case': case.name, 'op': case.op, 'dtype': case.dtype, 'tokens': case.tokens,"
            " 'shapes': case.shapes, 'config': case.config, 'seed': case.seed, 'checkpoint': files,"
            " 'runners': case.runners}))")
    _, done = timed([python, "-c", code], repo, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_runner(repo: Path, python: str, runner: str, fields: dict, folder: Path,
               device: str = "cpu") -> tuple[float, float, dict]:
    """One runner process alone on the case's request: its wall seconds, CPU seconds and meta.json."""
    folder.mkdir(parents=True)
    request = {"schema": 1, "device": device, "tp": 1, **{k: v for k, v in fields.items() if k != "runners"},
               "output_dir": str(folder)}
    (folder / "request.json").write_text(json.dumps(request))
    seconds, done = timed([python, "-m", f"harness.runners.{runner}", "--request", str(folder / "request.json")],
                          repo, timeout=1800)
    meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").exists() else {}
    if done.returncode != 0:
        print(f"  {runner} exited {done.returncode}: {done.stderr[-400:]}", file=sys.stderr)
    return seconds, cpu_of(done), meta


def framework_work(meta: dict) -> float:
    return sum(seconds for name, seconds in meta.get("phases", {}).items() if name != "import")


def measure_compare(repo: Path, python: str, tokens: int, scratch: Path, round_number: str) -> dict:
    fields = prepare_checkpoint(repo, python, tokens)
    floor, cpu = {}, {}
    for runner in ("megatron", "paddle", "oracle"):
        floor[runner], cpu[runner], _ = run_runner(repo, python, runner, fields, scratch / f"r{round_number}-{runner}")
    reports = scratch / f"r{round_number}-reports"
    compare_seconds, done = timed([python, "-m", "harness", "compare", CASE, "--tokens", str(tokens),
                                   "--reports", str(reports)], repo, timeout=3600)
    report = report_of(reports, done)
    slower = max(floor["megatron"], floor["paddle"])
    return {"compare_s": compare_seconds, "verdict": report.get("verdict"), "exit": done.returncode,
            "megatron_s": floor["megatron"], "paddle_s": floor["paddle"], "oracle_s": floor["oracle"],
            "floor_s": floor["megatron"] + floor["paddle"],
            "compare / floor": compare_seconds / (floor["megatron"] + floor["paddle"]),
            "oracle / slower side": floor["oracle"] / slower,
            "cpu_s": {"compare": cpu_of(done), **cpu},
            "cpu: compare / floor": cpu_of(done) / (cpu["megatron"] + cpu["paddle"]),
            "cpu: oracle / slower side": cpu["oracle"] / cpu[max(("megatron", "paddle"), key=floor.get)],
            "sides_in_compare_s": {s["label"]: round(s["wall_seconds"], 2) for s in report.get("sides", [])}}


def measure_sweep(repo: Path, python: str, tokens: list[int], scratch: Path, extra: list[str]) -> dict:
    reports = Path(tempfile.mkdtemp(prefix="sweep-reports-", dir=scratch))
    seconds, done = timed([python, "-m", "harness", "compare", CASE, "--tokens", ",".join(map(str, tokens)),
                           "--reports", str(reports), *extra], repo, timeout=3600)
    sweep = report_of(reports, done)
    work = [max((framework_work(side.get("meta", {})) for side in cell["sides"] if side["label"] in ("a", "b")),
                default=0.0) for cell in sweep.get("cells", [])]
    per_cell = seconds / max(1, len(tokens))
    mean_work = statistics.mean(work) if work else float("nan")
    return {"sweep_s": seconds, "cpu_s": cpu_of(done), "cells": len(tokens), "exit": done.returncode,
            "wall_per_cell_s": per_cell,
            "framework_work_per_cell_s": mean_work, "sweep cell / framework work": per_cell / mean_work,
            "verdicts": sweep.get("verdicts")}


def measure_model(repo: Path, python: str, scratch: Path) -> dict:
    """``compare kimi_k2_2layer`` (truth on) against its sides' runner processes alone, less their write phases."""
    fields = prepare_checkpoint(repo, python, MODEL_TOKENS, MODEL_CASE)
    floor, sides = 0.0, {}
    for runner in fields["runners"]:
        seconds, cpu, meta = run_runner(repo, python, runner, fields, Path(tempfile.mkdtemp(dir=scratch)) / runner)
        written = meta.get("phases", {}).get("write", 0.0)
        sides[runner] = {"wall_s": seconds, "write_s": written, "cpu_s": cpu}
        floor += seconds - written
    reports = Path(tempfile.mkdtemp(prefix="model-reports-", dir=scratch))
    compare_seconds, done = timed([python, "-m", "harness", "compare", MODEL_CASE, "--tokens", str(MODEL_TOKENS),
                                   "--reports", str(reports)], repo, timeout=3600)
    report = report_of(reports, done)
    return {"compare_s": compare_seconds, "cpu_s": cpu_of(done), "verdict": report.get("verdict"),
            "exit": done.returncode, "floor_s": floor, "sides_alone": sides,
            "model: compare / floor": compare_seconds / floor,
            "sides_in_compare_s": {s["label"]: round(s["wall_seconds"], 2) for s in report.get("sides", [])}}


def measure_catalogue(device: str, tokens: list[int], reports: Path, extra: list[str], jobs: int = 1) -> dict:
    """Every op-level case of `device` swept over `tokens`, in this process, with one pool of runner workers, `jobs`
    cases at once (placed as a nightly's ``--workers`` cells, up to `jobs` of them on one GPU); per case its wall and
    where it went (checkpoints, each side's phases summed over its cells, the harness's own rest)."""
    from harness.case.registry import Registry
    from harness.commands.sweep import run_sweep
    from harness.levels import level_of
    from harness.pipeline import CompareOptions
    from harness.run import placement, workers

    gpus = len(placement.visible_gpus()) if device == "gpu" else None
    cases, left_out, tp = [], {}, {}
    for case in Registry.load().for_device(device):
        if level_of(case).name != "op" or (gpus is not None and case.tp > gpus):
            continue
        weights = case.weights_from
        if weights and not weights.package and not weights.file:
            left_out[case.name] = "needs --weights FILE"
        elif weights and weights.package and importlib.util.find_spec(weights.package) is None:
            left_out[case.name] = f"weights package {weights.package} not installed"
        else:
            cases.append(case.name)
            tp[case.name] = case.tp
    for name, why in left_out.items():  # a cell that cannot start measures nothing: named, not counted
        print(f"  {name}: not run ({why})", flush=True)
    options = CompareOptions(device=device, reports_dir=reports, checkpoints_dir=reports / "checkpoints",
                             oracle="--no-oracle" not in extra,
                             fresh_process="--fresh-process" in extra)

    def drop_tensors(line: str) -> None:
        """After each cell (full-size cells write GBs each): the tensors of cells whose report is written. A sweep
        finishes a cell while the next one runs, so the next cell's fresh outputs must stay (dropping every file
        here made that cell ERROR with its outputs missing, on the H200 and on the CPU)."""
        for report in reports.glob("2*/*/report.json"):
            for tensors in report.parent.glob("*/*.safetensors"):
                tensors.unlink()

    def one(name: str) -> None:
        clock = time.perf_counter()
        sweep, folder = run_sweep(name, tokens, options=options, progress=drop_tensors)
        summary[name] = {"seconds": round(time.perf_counter() - clock, 1), "verdicts": sweep["verdicts"],
                         **_where_it_went(folder, sweep), "errors": _errors(sweep)}
        print(f"  {name}: {summary[name]['verdicts']} in {summary[name]['seconds']} s: "
              f"{_breakdown(summary[name])}", flush=True)
        for error in summary[name]["errors"]:  # the reports go with the bench's folder: what went wrong stays here
            print(f"    ERROR at {error['tokens']} tokens: {error['message']}", flush=True)
        shutil.rmtree(reports / "checkpoints" / name, ignore_errors=True)  # its inputs; weights are shared

    started, summary = time.perf_counter(), {}
    with workers.fresh_processes(options.fresh_process), workers.serving(reports / "workers"):
        placement.run_cells(cases, one, workers=jobs, device=device, cells_per_gpu=jobs,
                            tp_of=tp.get)
    return {"device": device, "tokens": tokens, "cases": len(cases), "cells": len(cases) * len(tokens),
            "left_out": left_out, "jobs": jobs,
            "wall_s": round(time.perf_counter() - started, 1), "oracle": options.oracle,
            "fresh_process": options.fresh_process, "threads": os.cpu_count(),
            "per_case": {name: summary[name] for name in cases if name in summary}}


def _errors(sweep: dict) -> list[dict]:
    """Each ERROR cell's token count, message and its sides' stderr tails (cut to 2,000 characters)."""
    errors = []
    for cell in sweep["cells"]:
        if cell["verdict"] == "ERROR":
            tails = " | ".join(f"{side['label']}: {side.get('reason', '')} {(side.get('stderr_tail') or '')[-600:]}"
                               for side in cell["sides"] if side.get("status") == "error")
            errors.append({"tokens": cell["tokens"], "message": f"{cell['message']} {tails}"[:2000]})
    return errors


def _where_it_went(folder: Path, sweep: dict) -> dict:
    """Seconds summed over a sweep's cells: checkpoints made or checked, each side's phases (from its meta.json), and
    the rest of each cell's wall (the harness: worker round trips, output checks, reports)."""
    harness: dict[str, float] = {}
    sides: dict[str, float] = {}
    for cell in sweep["cells"]:
        report = json.loads((folder / cell["run_dir"] / "report.json").read_text())
        for phase, seconds in report["harness"].get("seconds", {}).items():
            harness[phase] = harness.get(phase, 0.0) + seconds
        for side in cell["sides"]:
            for phase, seconds in side["meta"].get("phases", {}).items():
                key = f"{side['label']}.{phase}"
                sides[key] = sides.get(key, 0.0) + seconds
    walls = sum(cell["wall_seconds"] for cell in sweep["cells"])
    return {**{f"{phase}_s": round(harness.get(phase, 0.0), 2) for phase in ("checkpoint", "runners", "compare")},
            "rest_s": round(walls - sum(harness.values()), 2),
            "side_phases_s": {k: round(v, 2) for k, v in sorted(sides.items())}}


def _breakdown(entry: dict) -> str:
    phases = ", ".join(f"{k} {v}" for k, v in entry["side_phases_s"].items() if v >= 0.05)
    return (f"checkpoints {entry['checkpoint_s']} s, runners {entry['runners_s']} s ({phases}), compare "
            f"{entry['compare_s']} s, reports and rest {entry['rest_s']} s")


def step_seconds(meta: dict) -> float:
    return sum(each_step(meta))


def each_step(meta: dict) -> list[float]:
    """Each step's seconds, in order (a step's phase in meta.json): the first pays allocations the others reuse."""
    return [round(seconds, 3) for name, seconds in meta.get("phases", {}).items() if name.startswith("step ")]


def measure_train(repo: Path, python: str, case: str, runners: list[str], scratch: Path, device: str = "cpu") -> dict:
    """The compare of a training case against each stack's bare loop alone (see the module docstring)."""
    fields = prepare_checkpoint(repo, python, None, case)
    bare_fields = {**fields, "config": {**fields["config"], "train": {**fields["config"]["train"], "bare": True}}}
    bare = {}
    for runner in runners:
        seconds, cpu, meta = run_runner(repo, python, runner, bare_fields,
                                        Path(tempfile.mkdtemp(dir=scratch)) / f"bare-{runner}", device)
        bare[runner] = {"wall_s": seconds, "cpu_s": cpu, "steps_s": step_seconds(meta), "each_step_s": each_step(meta)}
    reports = Path(tempfile.mkdtemp(prefix="train-reports-", dir=scratch))
    seconds, done = timed([python, "-m", "harness", "compare", case, "--runners", ",".join(runners), "--no-oracle",
                           "--device", device, "--reports", str(reports)], repo, timeout=7200)
    report = report_of(reports, done)
    sides = {s["label"]: s for s in report.get("sides", [])}
    floor = sum(b["wall_s"] for b in bare.values())
    steps = fields["config"]["train"]["steps"]
    measured = {"case": case, "runners": runners, "steps": steps, "compare_s": seconds, "cpu_s": cpu_of(done),
                "verdict": report.get("verdict"), "exit": done.returncode, "bare": bare, "bare_floor_s": floor,
                "train: compare / bare floor": seconds / floor,
                "first_divergence": (report.get("train") or {}).get("first_divergence")}
    for label, runner in zip("ab", runners, strict=True):
        meta = sides.get(label, {}).get("meta", {})
        inside = step_seconds(meta)
        measured[f"train: {label}: dumps: steps / bare steps"] = inside / bare[runner]["steps_s"]
        measured[f"{label}_steps_s"], measured[f"{label}_each_step_s"] = inside, each_step(meta)
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.commands.bench_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="compare/floor rounds; ratios are per round")
    parser.add_argument("--sweep-tokens", default="8,16,24,32,40,48,56,64")
    parser.add_argument("--sweep-args", default="", help="extra compare arguments for both sweeps (e.g. --device gpu)")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-compare", action="store_true", help="no single compare (e.g. on a GPU: "
                                                                    "--sweep-args='--device gpu')")
    parser.add_argument("--skip-model", action="store_true", help="no model-level compare")
    parser.add_argument("--before", type=Path, help="also measure this tree (e.g. today's main), side by side")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--catalogue", choices=("cpu", "gpu"), help="time the device's whole catalogue instead")
    parser.add_argument("--catalogue-tokens", default="1,7,60,61,64,127,128,255,256,1024,4096")
    parser.add_argument("--catalogue-args", default="--no-oracle", help="--no-oracle and/or --fresh-process")
    parser.add_argument("--catalogue-jobs", type=positive, default=1,
                        help="cases at once (on a GPU: sharing it, as nightly --workers N --cells-per-gpu N)")
    parser.add_argument("--reports", type=Path, help="with --catalogue: keep the reports here (default: a temporary "
                                                     "folder, removed)")
    parser.add_argument("--skip-train", action="store_true", help="no training case")
    parser.add_argument("--train-case", default=TRAIN_CASE, help="the training case timed against the bare loops")
    parser.add_argument("--train-runners", default="megatron_model,paddle_model")
    parser.add_argument("--train-device", default="cpu", choices=("cpu", "gpu"),
                        help="where the training case and its bare loops run (gpu: kimi_k2_2layer_train_full)")
    args = parser.parse_args(argv)
    if args.catalogue:
        return _catalogue(args)
    trees = {"after": args.repo.resolve(), **({"before": args.before.resolve()} if args.before else {})}
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"speed bench, {os.cpu_count()} CPUs, load average {load}; "
          + "; ".join(f"{name}: {repo} (commit {_commit(repo)}, code {_code(repo)})" for name, repo in trees.items()))
    results: dict = {name: {"repo": str(repo), "commit": _commit(repo), "code": _code(repo), "rounds": []}
                     for name, repo in trees.items()}
    results["load_before"] = load
    order = sorted(trees, reverse=True)  # before, then after: each measurement of the two trees back to back
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as scratch:
        for number in range(0 if args.skip_compare else args.rounds):
            for name in order:
                measured = measure_compare(trees[name], args.python, args.tokens, Path(scratch), f"{name}{number}")
                results[name]["rounds"].append(measured)
                print(f"{name} round {number + 1}: compare {measured['compare_s']:.1f} s ({measured['verdict']}); "
                      f"floor megatron {measured['megatron_s']:.1f} s + paddle {measured['paddle_s']:.1f} s = "
                      f"{measured['floor_s']:.1f} s; oracle alone {measured['oracle_s']:.1f} s; sides inside "
                      f"compare {measured['sides_in_compare_s']}; CPU seconds {_rounded(measured['cpu_s'])}")
        sweeps = {"sweep": ["--no-oracle"], "sweep_oracle": []}
        for key, oracle in ({} if args.skip_sweep else sweeps).items():
            tokens = [int(t) for t in args.sweep_tokens.split(",")]
            for name in order:
                s = results[name][key] = measure_sweep(trees[name], args.python, tokens, Path(scratch),
                                                       [*oracle, *args.sweep_args.split()])
                print(f"{name} {key.replace('_', ' with ')} of {s['cells']} token counts: {s['sweep_s']:.1f} s, "
                      f"{s['wall_per_cell_s']:.2f} s per cell ({s['cpu_s'] / s['cells']:.2f} CPU s per cell), "
                      f"framework work {s['framework_work_per_cell_s']:.2f} s per cell; verdicts {s['verdicts']}")
        for name in ([] if args.skip_model else order):
            m = results[name]["model"] = measure_model(trees[name], args.python, Path(scratch))
            alone = ", ".join(f"{runner} {v['wall_s']:.1f} s less write {v['write_s']:.1f} s"
                              for runner, v in m["sides_alone"].items())
            print(f"{name} model: compare {MODEL_CASE} {m['compare_s']:.1f} s ({m['verdict']}); floor "
                  f"{m['floor_s']:.1f} s ({alone}); sides inside compare {m['sides_in_compare_s']}")
        for name in ([] if args.skip_train else order):
            t = results[name]["train"] = measure_train(trees[name], args.python, args.train_case,
                                                       args.train_runners.split(","), Path(scratch),
                                                       args.train_device)
            bare = ", ".join(f"{r} {b['wall_s']:.1f} s ({b['steps_s'] / t['steps']:.2f} s per step)"
                             for r, b in t["bare"].items())
            print(f"{name} train: compare {t['case']} {t['compare_s']:.1f} s for {t['steps']} steps ({t['verdict']}); "
                  f"bare loops alone: {bare}")
            if t["steps"] <= 10:  # each step, in the compare and bare: the first pays what the others reuse
                print(f"{name} train: each step, in the compare / bare: " + "; ".join(
                    f"{r} {t.get(f'{label}_each_step_s')} / {t['bare'][r]['each_step_s']}"
                    for label, r in zip("ab", t["runners"], strict=True)))
    print(f"{'ratio (wall unless cpu:)':<40} {'goal':>6} " + " ".join(f"{name:>8}" for name in order))
    for ratio, goal in GOALS.items():
        row = {name: _ratio(results[name], ratio) for name in order}
        if any(row.values()):
            print(f"{ratio:<40} {'<= ' + str(goal) if goal else '':>6} "
                  + " ".join(f"{statistics.median(v):>8.2f}" if v else f"{'-':>8}" for v in row.values())
                  + "".join(f"  ({name} rounds: {', '.join(f'{x:.2f}' for x in v)})" for name, v in row.items()
                            if len(v) > 1))
    results["load_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def _ratio(tree: dict, ratio: str) -> list[float]:
    """Every measurement of `ratio` in one tree's results (one per round for the single compare)."""
    if ratio == "sweep cell / framework work, oracle on":
        return [tree["sweep_oracle"]["sweep cell / framework work"]] if "sweep_oracle" in tree else []
    if ratio == "sweep cell / framework work":
        return [tree["sweep"][ratio]] if "sweep" in tree else []
    if ratio.startswith(("model:", "train:")):
        part = tree.get(ratio.split(":")[0], {})
        return [part[ratio]] if ratio in part else []
    return [r[ratio] for r in tree["rounds"]]


def _catalogue(args) -> int:
    tokens = [int(t) for t in args.catalogue_tokens.split(",")]
    print(f"catalogue bench: every {args.catalogue} case over {len(tokens)} token counts ({args.catalogue_args})")
    with tempfile.TemporaryDirectory(prefix="bench-catalogue-") as scratch:
        measured = measure_catalogue(args.catalogue, tokens, args.reports or Path(scratch), args.catalogue_args.split(),
                                     args.catalogue_jobs)
    print(f"{measured['cases']} cases x {len(tokens)} token counts = {measured['cells']} cells in "
          f"{measured['wall_s']} s ({measured['wall_s'] / max(1, measured['cells']):.2f} s per cell, "
          f"{measured['jobs']} case(s) at once)")
    if args.json:
        args.json.write_text(json.dumps(measured, indent=2) + "\n")
    return 0


def _rounded(values: dict) -> dict:
    return {k: round(v, 1) for k, v in values.items()}


def _code(repo: Path) -> str:
    """A digest of the tree's code and cases (``harness/**/*.py``, ``cases/*.toml``: paths and bytes): names what ran
    where the commit cannot (an archive, uncommitted edits, a copy whose .git is not the tree's, as on the device
    machine, whose copies of this checkout named an older commit than the tree they held)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted([*repo.glob("harness/**/*.py"), *repo.glob("cases/*.toml")]):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _commit(repo: Path) -> str:
    """The tree's commit; a tree that is not a checkout's top (an archive unpacked inside one) has none of its own."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True).stdout.strip()

    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != repo.resolve():
        return "not a git checkout"
    return git("rev-parse", "--short", "HEAD")


if __name__ == "__main__":
    raise SystemExit(main())
