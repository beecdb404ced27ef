"""Capture APIs, one module per framework (``torch``, ``paddle``): module outputs by forward hooks and parameter
gradients, written in the canonical names of docs/model-contract.md. Each imports only its own framework."""
