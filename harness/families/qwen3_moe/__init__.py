"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): grouped-query attention with per-head q/k RMSNorm and head_dim wider
than hidden / heads, full RoPE, no attention bias, and in every layer a MoE block of routed experts behind a softmax
router whose top-k probabilities are renormalised (norm_topk_prob); no shared expert, no routing bias.

Here: the typed config (``config.py``, Qwen3-30B-A3B's values as defaults), the canonical tensors (``layout.py``), the
name maps and float64 floors (``names.toml``), and one builder per stack (``megatron.py``, ``hf.py``, ``paddle.py``).
"""

from pathlib import Path

from harness.families.qwen3_moe import layout
from harness.families.qwen3_moe.config import Qwen3MoeConfig
from harness.families.record import Family

FAMILY = Family(
    name=Qwen3MoeConfig.family, config=Qwen3MoeConfig, folder=Path(__file__).resolve().parent,
    parameters=layout.parameters, gradients=layout.gradients, modules=layout.modules,
    dense_layers=layout.dense_layers, moe_layers=layout.moe_layers, routed_experts=layout.routed_experts,
    sliced_by_expert=("mlp.gate.weight",), interleave=layout.interleave,
)
