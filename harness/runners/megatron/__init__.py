"""Megatron-Core (torch + megatron.core only; no Transformer Engine, no Apex).

``runner.py`` is the op-level entry (process group, parallel state, this rank's shard) over the op table ``ops.py``;
``model.py`` builds a whole ``GPTModel``. What they adapt (each named in meta.json, none changing a computation):
on the CPU ``torch.cuda.current_device`` answers ``"cpu"`` and the RNG tracker starts without CUDA; 0.16.1's
``te_general_gemm`` is None without TE; a family's own come from its builder (DeepSeek-V3's
``MLADotProductAttention`` lets the local attention accept MLA's head sizes): ``families.py`` builds every family from
its architecture, with the modules of ``blocks.py``.
Each module-level patch lasts one cell (``harness.run.cell_state.patch``), and ``runner.cell_state`` puts back torch's
settings and Megatron's RNG tracker when a cell ends (docs/process-state.md).
Device setup and determinism come from ``harness.runners.torch.env`` (shared by every torch-based runner).
"""
