"""PyTorch without Megatron: plain torch ops (``runner.py``, runners ``torch`` and ``torch_nn``) and HF transformers'
whole models (``hf_model.py``); ``env.py`` holds device setup, determinism settings and provenance for every
torch-based runner (Megatron's too). Nothing here is adapted: HF's float64 mode replaces its five float32 islands
for a float64 request only, and says so in meta.json.
"""
