"""Runner subprocesses, one module per framework: ``python -m harness.runners.<name> --request FILE``.

A runner imports only its own framework (plus the framework-free ``protocol`` and ``harness.ops``),
reads the request and the checkpoint, runs the op forward and backward, and writes
``outputs.safetensors`` (canonical names and layout) and ``meta.json`` into the request's output folder.
"""
