"""Runner subprocesses, one module per framework: ``python -m harness.runners.<name> --request FILE``.

A runner imports only its own framework (plus the framework-free ``protocol`` and ``harness.ops``),
reads the request and the checkpoint, runs the op forward and backward, and writes
``outputs.safetensors`` (canonical names and layout) and ``meta.json`` into the request's output folder.

Runners: ``megatron`` (Megatron-Core ops, ``megatron_ops``), ``paddle``, ``torch`` / ``torch_nn``, ``oracle``;
``megatron_model``: a whole Megatron-Core ``GPTModel`` (local spec, MLA attention, MoE with ``SequentialMLP``)
for op ``causal_lm`` from a DeepSeek-V3/Kimi-K2 config in HF key names and an HF-named checkpoint, mapped through
``harness/case/models/deepseek_v3.toml`` (``docs/model-contract.md``).
"""
