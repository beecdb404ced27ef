"""``python -m harness reductions``: are the collectives' sums correctly rounded? All-reduce, reduce-scatter and
all-gather over 2 to 8 ranks (torchrun; gloo on the CPU, NCCL on GPUs: the same rank code,
``harness.runners.torch.collectives``), each element checked against the correctly rounded sum of the ranks'
messages (``harness.compare.collectives``). A new folder per run with report.json and report.md.

Exit codes: 0 every element of every reduction is the correctly rounded sum (and every all-gather the messages'
bits); 1 (DIFF) some are not, the table says where; 2 (ERROR) a world size's ranks failed or hung.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness.case.collectives import COLLECTIVES, DTYPES, SIZES, WORLD_SIZES, problem
from harness.compare.collectives import check
from harness.compare.result import EXIT_CODES
from harness.pipeline import failsafe, run_folder
from harness.report import blocks as doc
from harness.report.blocks import h, table, ul
from harness.run import launch, supervisor
from harness.run.orchestrate import REPO_ROOT, runner_env
from harness.run.protocol import host_provenance

SEED = 46


def add_parser(commands) -> None:
    parser = commands.add_parser("reductions", help="all-reduce, reduce-scatter and all-gather over N ranks, each "
                                                    "element against the correctly rounded sum "
                                                    "(docs/batch-invariance.md)")
    parser.add_argument("--ranks", type=_counts, default=list(WORLD_SIZES), metavar="N,N,...",
                        help=f"world sizes (default {','.join(map(str, WORLD_SIZES))})")
    parser.add_argument("--sizes", type=_counts, default=list(SIZES), metavar="N,N,...",
                        help="elements per rank, each a multiple of every world size (default "
                             f"{','.join(map(str, SIZES))})")
    parser.add_argument("--dtypes", type=_dtypes, default=list(DTYPES), metavar="DTYPE,...",
                        help=f"message dtypes (default {','.join(DTYPES)})")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: gloo; gpu: NCCL, one GPU per rank")
    parser.add_argument("--timeout", type=failsafe.seconds, default=600.0, help="seconds per world size")
    parser.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)


def main(args) -> int:
    for world in args.ranks:
        if problem(args.sizes, world):
            raise SystemExit(f"--sizes: {problem(args.sizes, world)} (reduce-scatter gives each rank an equal shard)")
    report, folder = run(args.ranks, args.sizes, args.dtypes, args.device, args.timeout, Path(args.reports))
    for line in lines(report):
        print(line)
    print(f"report: {folder / 'report.md'}  (exit code {report['exit_code']})")
    return report["exit_code"]


def run(worlds: list[int], sizes: list[int], dtypes: list[str], device: str, timeout: float,
        reports: Path) -> tuple[dict, Path]:
    run_id, folder = run_folder.new_run_dir(reports, "reductions")
    backend = "nccl" if device == "gpu" else "gloo"
    rows, errors = [], []
    for world in worlds:
        ranks_dir = folder / f"world{world}"
        ranks_dir.mkdir()
        request = {"seed": SEED, "dtypes": dtypes, "sizes": sizes, "backend": backend,
                   "output_dir": str(ranks_dir.resolve())}
        (ranks_dir / "request.json").write_text(json.dumps(request, indent=2))
        error = _launch(world, ranks_dir, device, timeout)
        if error:
            errors.append(f"{world} ranks: {error}")
            continue
        rows += check(ranks_dir, SEED, world, dtypes, sizes)
        print(f"{world} ranks: {sum(r['status'] == 'DIFF' for r in rows if r['world'] == world)} of "
              f"{sum(r['world'] == world for r in rows)} collectives not correctly rounded", file=sys.stderr)
    code = EXIT_CODES["ERROR"] if errors else EXIT_CODES["DIFF"] if any(r["status"] == "DIFF" for r in rows) else 0
    report = {"kind": "reductions", "run_id": run_id, "device": device, "backend": backend, "seed": SEED,
              "worlds": worlds, "sizes": sizes, "dtypes": dtypes, "argv": sys.argv, "host": host_provenance(),
              "errors": errors, "exit_code": code, "rows": rows, "finished_at": run_folder.now()}
    (folder / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (folder / "report.md").write_text(doc.markdown(blocks(report)))
    return report, folder


def _launch(world: int, folder: Path, device: str, timeout: float) -> str:
    """Run `world` ranks under torchrun; "" when every rank wrote its results, else why not."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--nnodes", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(launch.free_port()), "--max-restarts", "0",
               "--log-dir", str(folder / launch.RANK_LOGS), "--redirects", "3",
               "-m", "harness.runners.torch.collectives", "--request", str(folder / "request.json")]
    with supervisor.watch(), open(folder / "stderr.log", "wb") as err:
        with supervisor.starting():
            process = subprocess.Popen(command, stdout=err, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                       env=runner_env(device), start_new_session=True)
            supervisor.register(process)
        code, seen = launch.wait(process, timeout)
        if code is None:
            launch.kill_tree(process)
            return f"timed out after {timeout:g} s; its ranks were killed"
        launch.kill_leftovers(seen)
    missing = [r for r in range(world) if not (folder / f"outputs.rank{r}.safetensors").exists()]
    if code or missing:
        tails = launch.rank_tails(folder, world)
        return f"torchrun exited {code}, ranks without results: {missing}; " + " | ".join(
            f"rank {r}: {tail[-300:]}" for r, tail in tails.items())
    return ""


def lines(report: dict) -> list[str]:
    """Per collective and dtype: in how many (world size, message size) pairs every element is correctly rounded,
    and the worst of the others."""
    out = []
    for name in COLLECTIVES:
        for dtype in report["dtypes"]:
            rows = [r for r in report["rows"] if r["collective"] == name and r["dtype"] == dtype]
            off = [r for r in rows if r["status"] == "DIFF"]
            worst = max(off, key=lambda r: r["mismatches"] / r["elements"], default=None)
            out.append(f"{name} {dtype}: correctly rounded in {len(rows) - len(off)} of {len(rows)} (ranks x size)"
                       + (f"; worst {worst['world']} ranks x {worst['size']}: {worst['mismatches']} of "
                          f"{worst['elements']} elements off, max {worst['max_ulp']} ULP, "
                          f"{worst['max_error_in_scale_ulps']:.3g} at scale" if worst else ""))
    return out + [f"ERROR {e}" for e in report["errors"]]


def blocks(report: dict) -> list[tuple]:
    rows = [[r["collective"], r["dtype"], r["world"], r["size"], r["mismatches"],
             f"{r['mismatches'] / r['elements']:.4%}", r["max_ulp"], f"{r['max_error_in_scale_ulps']:.3g}",
             "yes" if r["ranks_agree"] else "no"]
            for r in report["rows"]]
    return [h(1, f"Collectives against the correctly rounded sum: {report['backend']} on {report['device']}"),
            ul([f"command: `{' '.join(report['argv'])}`", f"finished {report['finished_at']}; exit code "
                f"{report['exit_code']}", f"CPU: {report['host'].get('cpu', '')}", *lines(report)]),
            table(["collective", "dtype", "ranks", "elements per rank", "elements off (all ranks)", "share",
                   "max ULP", "max err in ULPs at scale", "ranks agree (a shard: = the all-reduce's)"], rows,
                  "llrrrrrrl")]


def _counts(text: str) -> list[int]:
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"expects positive integers separated by commas (got {text!r})")
    return counts


def _dtypes(text: str) -> list[str]:
    names = text.split(",")
    if not all(name in DTYPES for name in names):
        raise argparse.ArgumentTypeError(f"expects dtypes among {', '.join(DTYPES)} (got {text!r})")
    return names
