"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): attention with q/k/v biases (no qk-norm, no bias on o_proj), full
RoPE, and in every layer a MoE block: routed experts behind a softmax router whose top-k probabilities are NOT
renormalised (norm_topk_prob false), plus one shared expert whose output is scaled by a sigmoid gate
(``shared_expert_gate``, a Linear hidden -> 1); no routing bias.

Here: the typed config (``config.py``, Qwen1.5-MoE-A2.7B's values as defaults), the canonical tensors (``layout.py``),
the name maps and float64 floors (``names.toml``), and one builder per stack (``megatron.py``, ``hf.py``,
``paddle.py``).
"""

from pathlib import Path

from harness.families.qwen2_moe import layout
from harness.families.qwen2_moe.config import Qwen2MoeConfig
from harness.families.record import Family

FAMILY = Family(
    name=Qwen2MoeConfig.family, config=Qwen2MoeConfig, folder=Path(__file__).resolve().parent,
    parameters=layout.parameters, gradients=layout.gradients, modules=layout.modules,
    dense_layers=layout.dense_layers, moe_layers=layout.moe_layers, routed_experts=layout.routed_experts,
    sliced_by_expert=("mlp.gate.weight",), interleave=layout.interleave,
)
