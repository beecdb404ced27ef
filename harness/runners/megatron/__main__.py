"""``python -m harness.runners.megatron``: the megatron runner (``runner.py``)."""

from harness.runners.megatron.runner import main

main()
