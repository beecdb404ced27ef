"""PyTorch without Megatron: plain torch ops (``runner.py``, runners ``torch`` and ``torch_nn``) and HF transformers'
whole models (``hf_model.py``); ``env.py`` holds device setup, determinism settings and provenance for every
torch-based runner (Megatron's too). Nothing here is adapted: HF's float64 mode replaces its five float32 islands
for a float64 request only, says so in meta.json, and puts HF's own back when the cell ends; ``env.CELL_STATE`` lists
the torch settings every torch-based runner's cell gets back (docs/process-state.md).
"""
