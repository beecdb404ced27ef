"""``python -m harness.runners.oracle``: the oracle runner (``runner.py``)."""

from harness.runners.oracle.runner import main

main()
