"""DeepSeek-V3 (Kimi-K2's architecture): multi-latent attention, dense first layers, then MoE layers of routed experts
(sigmoid scores, a routing bias, top-k) and shared experts.

Here: the typed config (``config.py``, Kimi-K2's values as defaults), the canonical tensors (``layout.py``), the name
maps and float64 floors (``names.toml``), and one builder per stack (``megatron.py``, ``hf.py``, ``paddle.py``).
"""

from pathlib import Path

from harness.families.deepseek_v3 import layout
from harness.families.deepseek_v3.config import DeepseekV3Config
from harness.families.record import Family

FAMILY = Family(
    name=DeepseekV3Config.family, config=DeepseekV3Config, folder=Path(__file__).resolve().parent,
    parameters=layout.parameters, gradients=layout.gradients, modules=layout.modules,
    dense_layers=layout.dense_layers, moe_layers=layout.moe_layers, routed_experts=layout.routed_experts,
    sliced_by_expert=("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
)
