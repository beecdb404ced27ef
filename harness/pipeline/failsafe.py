"""How every run ends: a verdict, a report where one can be written, one clear line otherwise, never a traceback.

- ``record(result, error)``: any failure inside a run becomes its verdict: ERROR with the error's own message
  (a bad case, checkpoint or dump, a storage or memory limit, an unsafe name), or, for a failure of the harness
  itself, "harness failure" with the traceback kept in report.json (``harness.traceback``), never on the
  terminal. A signal makes it ERROR too, with the run marked interrupted (exit code 128 + the signal).
- ``finish(result, run_dir, write)``: writes the report; a report that cannot be written is a StorageError
  naming the path; a run that was interrupted is re-raised once its report is on disk, so a sweep or a night
  stops too.
- ``guarded(main)``: the command line's outermost frame: installs the signal handlers and the subreaper
  (``harness.run.supervisor``), and turns whatever escapes into one line on stderr and exit code 2 (130 for
  SIGINT, 143 for SIGTERM). Exit code 1 stays DIFF's alone.
- ``seconds``: the ``--timeout`` type; a negative, zero or NaN timeout is refused before anything runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from harness import paths, resources
from harness.case.checkpoints import CheckpointError
from harness.case.registry import CaseError
from harness.compare.dumps import DumpError
from harness.compare.result import ERROR, EXIT_CODES, CaseResult
from harness.pipeline import run_folder
from harness.run import shards, supervisor

# Errors whose message already says what went wrong and where: the message is the verdict's reason.
EXPECTED = (CaseError, CheckpointError, DumpError, paths.UnsafeName, resources.StorageError,
            resources.ResourceError, shards.GatherError)


def record(result: CaseResult, error: BaseException) -> None:
    """Make `error` the run's verdict (ERROR) and reason; SystemExit and GeneratorExit pass through."""
    if isinstance(error, (SystemExit, GeneratorExit)):
        raise error
    result.verdict = ERROR
    if isinstance(error, (supervisor.Interrupted, KeyboardInterrupt)):
        supervisor.stop_all()
        stop = _as_interrupted(error)
        result.interrupted, result.message = stop.signum, str(stop)
        result.harness["interrupted"] = {"signal": stop.name, "runners_stopped": supervisor.take_stopped()}
    else:
        result.message = message(error)
        if not isinstance(error, EXPECTED + (OSError, MemoryError)):
            result.harness["traceback"] = traceback.format_exception(error)


def message(error: BaseException) -> str:
    """One line for any error: its own message when it is one of ours, else what kind of failure it was."""
    if isinstance(error, EXPECTED):
        return str(error)
    if isinstance(error, OSError):
        return resources.describe(error, "or read")
    if isinstance(error, MemoryError):
        return f"out of memory: {error or 'an allocation failed'}; use fewer tokens or smaller shapes"
    return (f"harness failure: {type(error).__name__}: {error} (a bug in the harness, not a verdict on the "
            "frameworks; the traceback is in report.json under harness.traceback)")


def finish(result: CaseResult, run_dir: Path, write: Callable[[CaseResult, Path], None]) -> None:
    """Write the run's report (see the module docstring); re-raise an interruption once it is written."""
    result.finished_at = run_folder.now()
    try:
        with resources.boundary("report", run_dir):
            write(result, run_dir)
    except resources.StorageError:
        raise
    except (supervisor.Interrupted, KeyboardInterrupt) as error:  # the signal came while writing: write again
        record(result, error)
        _fallback(result, run_dir)
    except Exception as error:  # noqa: BLE001 - a renderer that fails still leaves report.json and report.md
        failure = message(error)
        result.verdict, result.message = ERROR, f"{result.message}; writing the report failed: {failure}"
        result.harness["report_traceback"] = traceback.format_exception(error)
        _fallback(result, run_dir)
    if result.interrupted:
        stop = supervisor.Interrupted(result.interrupted)
        stop.report = run_dir / "report.md"
        raise stop


def _fallback(result: CaseResult, run_dir: Path) -> None:
    """report.json and a short report.md, with nothing but json and str."""
    with resources.boundary("report", run_dir):
        try:
            data = result.to_dict()
        except Exception:  # noqa: BLE001
            data = {"run_id": result.run_id, "case_name": result.case_name, "verdict": result.verdict,
                    "exit_code": result.exit_code, "message": result.message, "harness": result.harness}
        (run_dir / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (run_dir / "report.md").write_text(f"# {result.case_name}: {result.verdict}\n\n- verdict: **{result.verdict}** "
                                           f"(exit code {result.exit_code}): {result.message}\n")


def _as_interrupted(error: BaseException) -> supervisor.Interrupted:
    return error if isinstance(error, supervisor.Interrupted) else supervisor.Interrupted(signal.SIGINT)


def guarded(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """The command line's outermost frame (see the module docstring)."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        supervisor.install()
        try:
            return main(argv)
        except (supervisor.Interrupted, KeyboardInterrupt) as error:
            supervisor.stop_all()
            stop = _as_interrupted(error)
            where = f"report: {stop.report}" if stop.report else "no report was written"
            say(f"{stop}; {where}")
            return stop.exit_code
        except Exception as error:  # noqa: BLE001 - the last frame: one line, exit code 2, never a traceback
            line = f"error: {message(error)}"
            if not isinstance(error, EXPECTED + (OSError, MemoryError)):
                where = _error_report(argv, error)
                line += f"; report: {where}" if where else ""
            say(line)
            return EXIT_CODES[ERROR]
        finally:
            supervisor.uninstall()

    return run


def say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _error_report(argv: list[str] | None, error: BaseException) -> Path | None:
    """Best effort: a run folder for a harness failure outside any one comparison, with its traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    root = run_folder.REPORTS_DIR
    for i, arg in enumerate(args):
        if arg == "--reports" and i + 1 < len(args):
            root = Path(args[i + 1])
        elif arg.startswith("--reports="):
            root = Path(arg.split("=", 1)[1])
    try:
        run_id, run_dir = run_folder.new_run_dir(root, "harness-error")
        result = CaseResult(run_id=run_id, case_name=" ".join(args[:2]) or "harness", device="",
                            message=message(error), started_at=run_folder.now(), finished_at=run_folder.now(),
                            harness={"argv": sys.argv, "traceback": traceback.format_exception(error)})
        _fallback(result, run_dir)
        return run_dir / "report.md"
    except Exception:  # noqa: BLE001 - nowhere to write: the line on stderr is all there is
        return None


def seconds(text: str) -> float:
    """``--timeout``: a positive number of seconds (``inf``: no limit)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expects a positive number of seconds (got {text!r})")
    return value
