"""Command line: ``python -m harness list | compare CASE | diff A B``; exit codes follow the verdict (see README)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness import pipeline, report
from harness.bits import FORMATS
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
    compare.add_argument("--reports", type=Path, default=pipeline.REPORTS_DIR)
    compare.add_argument("--checkpoints", type=Path, default=CHECKPOINTS_DIR)

    diff = commands.add_parser("diff", help="compare two dumps (safetensors file or folder, folder of .npy) by name")
    diff.add_argument("a", type=Path)
    diff.add_argument("b", type=Path, help="the reference side (relative error and scale)")
    diff.add_argument("--name-map", type=Path, help="JSON or TOML table: name in A = name in B")
    diff.add_argument("--layout", action="append", default=[], metavar="NAME=transpose",
                      help="bring B's tensor NAME (A's name) into A's layout, e.g. a Paddle [in, out] weight")
    diff.add_argument("--as-dtype", action="append", default=[], metavar="[NAME=]DTYPE",
                      help="read integer arrays (e.g. Paddle's uint16 bf16 bits) as DTYPE bit patterns")
    diff.add_argument("--reports", type=Path, default=pipeline.REPORTS_DIR)

    args = parser.parse_args(argv)
    if args.command == "list":
        return _list(args.cases)
    if args.command == "diff":
        return _diff(args)
    pythons = {}
    for item in args.python:
        runner, _, path = item.partition("=")
        if not path:
            parser.error(f"--python expects RUNNER=PATH (got {item!r})")
        pythons[runner] = path
    result, run_dir = pipeline.compare_case(
        args.case, device=args.device, tokens=args.tokens, cases_dir=args.cases, checkpoints_dir=args.checkpoints,
        reports_dir=args.reports, pythons=pythons, timeout=args.timeout, weights_file=args.weights)
    report.console(result, run_dir)
    return result.exit_code


def _diff(args) -> int:
    from harness import diff, dumps  # matplotlib and safetensors only when needed

    try:
        name_map = dumps.read_name_map(args.name_map) if args.name_map else {}
        layouts = dumps.parse_assignments(args.layout, "--layout", dumps.LAYOUTS)
        hints = dumps.parse_assignments(args.as_dtype, "--as-dtype", tuple(FORMATS), default_key="*")
    except dumps.DumpError as error:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/] {error}", highlight=False)
        return EXIT_CODES["ERROR"]
    result, run_dir = diff.diff_dumps(args.a, args.b, name_map=name_map, layouts=layouts, dtype_hints=hints,
                                      reports_dir=args.reports)
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
