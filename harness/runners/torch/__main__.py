"""``python -m harness.runners.torch``: the torch runner (``runner.py``)."""

from harness.runners.torch.runner import main

main()
