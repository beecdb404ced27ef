"""Command line: ``python -m harness list | compare CASE``; exit codes follow the verdict (see README)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness import gate_matrix, pipeline, report
from harness.cases import CASES_DIR, CaseError, Registry
from harness.checkpoints import CHECKPOINTS_DIR
from harness.result import EXIT_CODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    parser.add_argument("--cases", type=Path, default=CASES_DIR, help="folder of case TOML files")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("list", help="print the case registry")

    compare = commands.add_parser("compare", help="run one case on both runners and compare bit for bit")
    compare.add_argument("case")
    compare.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    compare.add_argument("--tokens", type=int, help="token count (rows of the input); default: the case's")
    compare.add_argument("--python", action="append", default=[], metavar="RUNNER=PATH",
                         help="interpreter for a runner, e.g. paddle=/envs/paddle/bin/python "
                              "(or set HARNESS_PYTHON_<RUNNER>)")
    compare.add_argument("--timeout", type=float, default=1800.0, help="seconds per runner before it is killed")
    compare.add_argument("--weights", help="safetensors file for cases that import their weights")
    compare.add_argument("--refeed", action="store_true",
                         help="multi-op blocks: re-run each op on side b from side a's tensors "
                              "(error made locally vs carried in)")
    compare.add_argument("--gate-matrix", action="store_true",
                         help="run with use_accuracy_compatible on and off and report both against side a")
    compare.add_argument("--reports", type=Path, default=pipeline.REPORTS_DIR)
    compare.add_argument("--checkpoints", type=Path, default=CHECKPOINTS_DIR)

    args = parser.parse_args(argv)
    if args.command == "list":
        return _list(args.cases)
    pythons = {}
    for item in args.python:
        runner, _, path = item.partition("=")
        if not path:
            parser.error(f"--python expects RUNNER=PATH (got {item!r})")
        pythons[runner] = path
    if args.gate_matrix:
        return gate_matrix.run(args.case, device=args.device, tokens=args.tokens, cases_dir=args.cases,
                               checkpoints_dir=args.checkpoints, reports_dir=args.reports, pythons=pythons,
                               timeout=args.timeout, weights_file=args.weights)
    result, run_dir = pipeline.compare_case(
        args.case, device=args.device, tokens=args.tokens, cases_dir=args.cases, checkpoints_dir=args.checkpoints,
        reports_dir=args.reports, pythons=pythons, timeout=args.timeout, weights_file=args.weights,
        refeed_ops=args.refeed)
    report.console(result, run_dir)
    return result.exit_code


def _list(cases_dir: Path) -> int:
    try:
        registry = Registry.load(cases_dir)
    except CaseError as error:
        Console(stderr=True).print(f"[red]error:[/] {error}", highlight=False)
        return EXIT_CODES["ERROR"]
    table = Table(title=f"cases in {cases_dir}")
    for column in ("case", "family", "op", "dtype", "tp", "tokens", "shapes", "runners", "devices", "expect"):
        table.add_column(column)
    for case in registry.cases.values():
        shapes = " ".join(f"{k}={v}" for k, v in case.shapes.items())
        table.add_row(case.name, case.family, case.op, case.dtype, str(case.tp), str(case.tokens), shapes,
                      " vs ".join(case.runners), ",".join(case.devices), case.expect.verdict)
    Console(width=200).print(table)
    return 0
