"""Capture module outputs and parameter gradients in canonical names, around any training step.

One module per framework with the same small interface (``harness.capture.torch``, ``harness.capture.paddle``);
each imports only its framework, safetensors and ``harness.case.models`` (standard library), so a runner or a
user's own training script can import it without the rest of the harness. See ``harness/capture/torch.py``.
"""
