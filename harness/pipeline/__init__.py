"""The pipeline: one comparison at any level (``comparison``), the folder each run gets (``run_folder``), and how
every run ends, with a verdict and a report (``failsafe``)."""

from harness.levels import Versus
from harness.pipeline.comparison import (
    DEFAULT_OPTIONS,
    FRESH_PROCESS_HELP,
    CompareOptions,
    Started,
    compare_case,
    describe_case,
    finish_case,
    start_case,
)

__all__ = ["DEFAULT_OPTIONS", "FRESH_PROCESS_HELP", "CompareOptions", "Started", "Versus", "compare_case",
           "describe_case", "finish_case", "start_case"]
