"""MiniMax-M2 (MiniMax-M2, M2.5, M2.7): grouped-query attention (48 query heads in 8 groups of 128) with one RMSNorm
over all heads of q and one over all heads of k (not per head), partial rotary (the first 64 of each head's 128
dims), and every layer MoE: 256 routed experts, top-8, sigmoid scores with a routing bias for the choice,
normalised, no routed scaling, no shared expert.

Here: the typed config (``config.py``, MiniMax-M2's values as defaults), the canonical tensors (``layout.py``:
transformers 5.3.0's module names), the name maps, the checkpoint's on-disk names and float64 floors
(``names.toml``), and one builder per stack (``megatron.py``: with the full-dimension q/k norm Megatron Bridge
provides for this family; ``hf.py``; ``paddle.py``: UNSUPPORTED, PaddleFormers has no dygraph MiniMax-M2).
"""

from pathlib import Path

from harness.families.minimax_m2 import layout
from harness.families.minimax_m2.config import MiniMaxM2Config
from harness.families.record import Family

FAMILY = Family(
    name=MiniMaxM2Config.family, config=MiniMaxM2Config, folder=Path(__file__).resolve().parent,
    parameters=layout.parameters, gradients=layout.gradients, modules=layout.modules,
    dense_layers=layout.dense_layers, moe_layers=layout.moe_layers, routed_experts=layout.routed_experts,
    sliced_by_expert=("mlp.gate.weight", "mlp.e_score_correction_bias"), interleave=layout.interleave,
)
