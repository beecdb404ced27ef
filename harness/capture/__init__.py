"""Capture APIs, one module per framework (``torch``, ``paddle``) with the same small interface: module outputs by
forward hooks and parameter gradients, written in the canonical names of docs/model-contract.md, around any training
step. Each imports only its own framework, safetensors and ``harness.case.models`` (standard library), so a runner or
a user's own training script can import it without the rest of the harness. See ``harness/capture/torch.py``."""
