"""Command line: ``python -m harness list | compare CASE | compare-runs RUN_A RUN_B | diff A B | doctor | nightly |
nightly-merge | publish DIR | baseline update | baseline record``; exit codes: see README."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness import pipeline
from harness.bits import FORMATS
from harness.case.checkpoints import CHECKPOINTS_DIR
from harness.case.ops import KNOBS
from harness.case.registry import CASES_DIR, RUNNERS, CaseError, Registry
from harness.case.select import SELECT_HELP, SelectError, select
from harness.commands import (
    baseline,
    batch_sweep,
    compare_runs,
    doctor,
    gate_matrix,
    nightly,
    nightly_merge,
    publish,
    reductions,
    state_for,
    sweep,
)
from harness.compare.result import EXIT_CODES
from harness.levels import AXES
from harness.pipeline import failsafe, run_folder
from harness.report import case_report as report
from harness.run.orchestrate import TRUTH

# Options renamed (old spelling -> the new one, given the old one's value); commit 9e6c533 made them one --versus
RENAMED = {f"--versus-{axis}": f"--versus {axis}=" for axis in ("tp", "dp", "ep", "impl")}


@failsafe.guarded  # signals, storage errors, harness failures: one line and an exit code, never a traceback
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    refuse_renamed(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    return run(parser, args)


def refuse_renamed(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An old spelling gets the new one (exit 2), not argparse's bare "unrecognized arguments"."""
    for i, arg in enumerate(argv):
        old, equals, value = arg.partition("=")
        if old in RENAMED:
            if not equals:
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "VALUE"
            parser.error(f"{old} was renamed: use {RENAMED[old]}{value}")


def build_parser() -> argparse.ArgumentParser:
    """Every command and option (tests/test_docs.py parses each command the docs quote with it)."""
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    parser.add_argument("--cases", type=Path, default=CASES_DIR, help="folder of case TOML files")
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("list", help="print the case registry")
    listing.add_argument("-k", dest="select", metavar="EXPRESSION", help=SELECT_HELP)

    compare = commands.add_parser("compare", help="run one case on both runners and compare bit for bit")
    compare.add_argument("case")
    compare.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    compare.add_argument("--tokens", type=token_counts, help="token count (rows of the input), or a list like "
                         "1,7,60,64 for a sweep (a matrix of tokens by tensors); default: the case's")
    compare.add_argument("--runners", type=runner_pair, action="append", metavar="A,B",
                         help="compare this pair of runners instead of the case's (megatron, paddle, torch, "
                              "torch_nn); give it twice or more to sweep several pairs")
    compare.add_argument("--python", action="append", default=[], metavar="RUNNER=PATH",
                         help="interpreter for a runner, e.g. paddle=/envs/paddle/bin/python "
                              "(or set HARNESS_PYTHON_<RUNNER>); truth=PATH for the truth side (default: this one, "
                              "never a side's)")
    compare.add_argument("--timeout", type=failsafe.seconds, default=1800.0,
                         help="seconds per runner before it is killed")
    compare.add_argument("--weights", help="safetensors file for cases that import their weights")
    compare.add_argument("--tp", type=int, help="tensor-parallel size (1, 2, 4, 8); default: the case's")
    compare.add_argument("--versus", type=versus, metavar="AXIS=VALUE",
                         help="one runner against itself: side a as the case says, side b at another tp=N (tensor "
                              "parallel), impl=LEVEL (the Paddle runner's implementation level: "
                              + ", ".join(KNOBS["paddle_impl"].choices) + "), dp=N or ep=N (training cases: data- "
                              "or expert-parallel ranks on the same global batch), batch=M (op cases: the case's rows "
                              "alone vs inside a batch of M other rows; model cases: its sequence alone vs first in a "
                              "batch of M other sequences; a list 1,2,4 or a range 1..64 of powers of two: one run "
                              "per M and a table of which M keep each tensor's bits), pad=P (model cases: the "
                              "sequence right-padded by P masked tokens beside another), cache=C (model cases, HF: "
                              "the logits computed C tokens a pass through the KV cache), environment=NAME (model "
                              "cases: hf_model against itself, side b in the named environment, e.g. "
                              "transformers-5.23.0)")
    compare.add_argument("--runner", help="the runner on both sides of --versus (default: the case's first)")
    compare.add_argument("--dp", type=int, help="training cases: data-parallel ranks, each training its own "
                                                "micro-batches of the same global batch (1, 2, 4, 8; default: the "
                                                "case's train.dp)")
    compare.add_argument("--ep", type=int, help="training cases: expert-parallel ranks among them (Megatron's MoE "
                                                "layer; default: the case's train.ep)")
    compare.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                         help="also run the framework-free truth oracle and show each side's distance from it "
                              "(default: on; ops without an oracle say so)")
    compare.add_argument("--repeat", type=int, default=1, metavar="N",
                         help="run each side N times (in its worker process) and once more in a fresh process; a side "
                              "that disagrees with itself gives NONDETERMINISTIC")
    compare.add_argument("--fresh-process", action="store_true", help=pipeline.FRESH_PROCESS_HELP)
    compare.add_argument("--refeed", action="store_true",
                         help="multi-op blocks: re-run each op on side b from side a's tensors; model cases: "
                              "replay side b with each module's input, output and output gradient from side a "
                              "(error made locally vs carried in)")
    compare.add_argument("--gate-matrix", action="store_true",
                         help="run with use_accuracy_compatible on and off and report both against side a")
    compare.add_argument("--paddle-impl", choices=KNOBS["paddle_impl"].choices,
                         help="the Paddle side's implementation level for this run (sets config.paddle_impl): auto, "
                              "paddlefleet, paddleformers or recipe; `python -m harness doctor` lists what exists here")
    compare.add_argument("--steps-kept", metavar="all|last|none|K,L,...",
                         help="training cases: the steps whose tensors stay on disk (default: the case's "
                              "train.steps_kept); the other steps keep their scalars and one digest per tensor")
    compare.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)
    compare.add_argument("--checkpoints", type=Path, default=CHECKPOINTS_DIR)
    nightly.add_parser(commands)
    nightly_merge.add_parser(commands)
    publish.add_parser(commands)
    baseline.add_parser(commands)
    doctor.add_parser(commands)
    compare_runs.add_parser(commands)
    reductions.add_parser(commands)
    state_for.add_parser(commands)

    diff = commands.add_parser("diff", help="compare two dumps (safetensors file or folder, folder of .npy) by name")
    diff.add_argument("a", type=Path)
    diff.add_argument("b", type=Path, help="the reference side (relative error and scale)")
    diff.add_argument("--name-map", type=Path, help="JSON or TOML table: name in A = name in B")
    diff.add_argument("--layout", action="append", default=[], metavar="NAME=transpose",
                      help="bring B's tensor NAME (A's name) into A's layout, e.g. a Paddle [in, out] weight")
    diff.add_argument("--as-dtype", action="append", default=[], metavar="[NAME=]DTYPE",
                      help="read integer arrays (e.g. Paddle's uint16 bf16 bits) as DTYPE bit patterns")
    diff.add_argument("--reports", type=Path, default=run_folder.REPORTS_DIR)
    return parser


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "list":
        return _list(args.cases, args.select)
    if args.command == "publish":
        return publish.main(args)
    if args.command == "diff":
        return _diff(args)
    if args.command == "nightly-merge":
        return nightly_merge.main(args)
    if args.command == "compare-runs":
        return compare_runs.main(args)
    if args.command == "reductions":
        return reductions.main(args)
    if args.command == "state-for":
        return state_for.main(args)
    pythons = {}
    for item in getattr(args, "python", []):  # `baseline update` runs nothing
        runner, _, path = item.partition("=")
        if not path or runner not in (*RUNNERS, TRUTH):
            parser.error(f"--python expects RUNNER=PATH with RUNNER one of {', '.join(RUNNERS)} or {TRUTH} (the "
                         f"truth's own) (got {item!r})")
        pythons[runner] = path
    if args.command == "nightly":
        return nightly.main(args, pythons)
    if args.command == "baseline":
        return baseline.main(args, pythons)
    if args.command == "doctor":
        return doctor.main(args, pythons)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1 (got {args.repeat})")
    options = pipeline.CompareOptions(
        device=args.device, tokens=args.tokens[0] if args.tokens else None, cases_dir=args.cases,
        checkpoints_dir=args.checkpoints, reports_dir=args.reports, pythons=pythons, timeout=args.timeout,
        weights_file=args.weights, tp=args.tp, oracle=args.oracle, dp=args.dp, ep=args.ep,
        versus=pipeline.Versus(*args.versus, args.runner) if args.versus and args.versus[0] != "batch" else None,
        repeat=args.repeat, refeed_ops=args.refeed, fresh_process=args.fresh_process, steps_kept=args.steps_kept,
        config_overrides={"paddle_impl": args.paddle_impl} if args.paddle_impl else {})
    if args.gate_matrix:
        return gate_matrix.run(args.case, replace(options, oracle=True, repeat=1, refeed_ops=False, versus=None,
                                                  tp=None, runners=(args.runners or [None])[0]))
    if args.versus and args.versus[0] == "batch":
        swept, batch_dir = batch_sweep.run(args.case, args.versus[1], args.runner, options)
        batch_sweep.console(swept, batch_dir)
        return swept["exit_code"]
    pairs = args.runners or [None]
    if len(args.tokens or ()) > 1 or len(pairs) > 1:
        swept, sweep_dir = sweep.run_sweep(args.case, args.tokens or [None], pairs, options)
        sweep.console(swept, sweep_dir)
        return swept["exit_code"]
    result, run_dir = pipeline.compare_case(args.case, replace(options, runners=pairs[0]))
    report.console(result, run_dir)
    return result.exit_code


def token_counts(text: str) -> list[int]:
    """`--tokens 60` or `--tokens 1,7,60,64`."""
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(count <= 0 for count in counts):
        raise argparse.ArgumentTypeError(f"expects positive integers separated by commas (got {text!r})")
    return counts


def versus(text: str) -> tuple[str, int | str | list[int]]:
    """`--versus tp=2`, `--versus impl=recipe`, `--versus dp=2`, `--versus batch=1..64`: (axis, side b's value; a
    number but for impl; a list of other-row counts for batch)."""
    axis, _, value = text.partition("=")
    if axis not in AXES or not value:
        raise argparse.ArgumentTypeError(f"expects AXIS=VALUE with AXIS one of {', '.join(AXES)} (got {text!r})")
    if axis == "batch":
        return axis, batch_sizes(value)
    if axis == "environment":  # a name (harness.environments), checked by the model level
        return axis, value
    if axis == "impl":
        if value not in KNOBS["paddle_impl"].choices:
            raise argparse.ArgumentTypeError(f"--versus impl expects one of {', '.join(KNOBS['paddle_impl'].choices)} "
                                             f"(got {value!r})")
        return axis, value
    try:
        return axis, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--versus {axis} expects a whole number (got {value!r})") from None


def batch_sizes(text: str) -> list[int]:
    """`64`, `1,2,4` or `1..64` (the powers of two from 1 to 64): counts of other rows, each at least 1."""
    low, dots, high = text.partition("..")
    try:
        if dots:
            low_n, high_n = int(low), int(high)
            sizes = [1 << k for k in range(high_n.bit_length()) if low_n <= 1 << k <= high_n]
        else:
            sizes = [int(item) for item in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"--versus batch expects counts of other rows of at least 1: M, M1,M2,... "
                                         f"or LOW..HIGH (powers of two) (got {text!r})")
    return sizes


def runner_pair(text: str) -> tuple[str, str]:
    pair = tuple(item.strip() for item in text.split(","))
    if len(pair) != 2 or any(r not in RUNNERS for r in pair):
        raise argparse.ArgumentTypeError(f"expects two of {', '.join(RUNNERS)} as A,B (got {text!r})")
    return pair

def _diff(args) -> int:
    from harness.commands import diff
    from harness.compare import dumps  # matplotlib and safetensors only when needed

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


def list_family(case) -> str:
    """What `list` groups a case by: its case family, and for a model case the model family it runs
    (harness/families/), e.g. ``model: glm4_moe``."""
    return f"{case.family}: {case.model.family}" if case.model is not None else case.family


def _list(cases_dir: Path, expression: str | None) -> int:
    try:
        cases = select(Registry.load(cases_dir).cases.values(), expression)
    except (CaseError, SelectError) as error:
        Console(stderr=True).print(f"[red]error:[/] {error}", highlight=False)
        return EXIT_CODES["ERROR"]
    table = Table(title=f"cases in {cases_dir}")
    for column in ("case", "family", "op", "dtype", "tp", "tokens", "shapes", "runners", "devices", "expect"):
        table.add_column(column)
    for case in sorted(cases, key=lambda c: (list_family(c), c.name)):
        shapes = " ".join(f"{k}={v}" for k, v in case.shapes.items())
        table.add_row(case.name, list_family(case), case.op, case.dtype, str(case.tp), str(case.tokens), shapes,
                      " vs ".join(case.runners), ",".join(case.devices), case.expect.verdict)
    Console(width=200).print(table)
    return 0
