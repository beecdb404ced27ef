"""GLM-4.5 MoE (GLM-4.5 and GLM-4.5-Air): grouped-query attention with biases on q, k and v, partial rotary (half of
each head), optional per-head q/k RMSNorm, dense first layers, then MoE layers of routed experts (sigmoid scores, a
routing bias, top-k, normalised, scaled) and a shared expert.

Here: the typed config (``config.py``, GLM-4.5-Air's values as defaults), the canonical tensors (``layout.py``), the
name maps and float64 floors (``names.toml``), and one builder per stack (``megatron.py``, ``hf.py``, ``paddle.py``).
"""

from pathlib import Path

from harness.families.glm4_moe import layout
from harness.families.glm4_moe.config import Glm4MoeConfig
from harness.families.record import Family

FAMILY = Family(
    name=Glm4MoeConfig.family, config=Glm4MoeConfig, folder=Path(__file__).resolve().parent,
    parameters=layout.parameters, gradients=layout.gradients, modules=layout.modules,
    dense_layers=layout.dense_layers, moe_layers=layout.moe_layers, routed_experts=layout.routed_experts,
    sliced_by_expert=("mlp.gate.weight", "mlp.gate.e_score_correction_bias"), interleave=layout.interleave,
)
