"""``python -m harness.runners.paddle``: the paddle runner (``runner.py``)."""

from harness.runners.paddle.runner import main

main()
