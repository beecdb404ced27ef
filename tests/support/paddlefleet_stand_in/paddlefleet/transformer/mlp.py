"""Stand-in for src/paddlefleet/transformer/mlp.py@9f9bd7b9: MLP's constructor (its projections built from the spec
with the arguments the source passes) and its forward's call structure with bias_activation_fusion: the projection,
``bias_swiglu_impl`` (``weighted_bias_swiglu_impl`` with a per-token scale) with the config's gate, the projection."""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from paddlefleet import record
from paddlefleet.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl


@dataclass
class MLPSublayersSpec:
    up_gate_proj: type = None
    hidden_act: type = None
    down_proj: type = None


class MLP(paddle.nn.Layer):
    def __init__(self, config, sublayers_spec: MLPSublayersSpec, is_expert: bool = False, input_size=None,
                 intermediate_size=None, hidden_size=None, tp_group=None, disable_fp8: bool = False):
        super().__init__()
        record("paddlefleet.transformer.mlp.MLP", config=config, is_expert=is_expert,
               intermediate_size=intermediate_size)
        if intermediate_size is None:
            raise ValueError("MoE MLP requires `intermediate_size`, but it was not provided.")
        self.config = config
        self.use_accuracy_compatible = getattr(config, "use_accuracy_compatible", False)
        size = config.hidden_size if input_size is None else input_size
        skip_bias_add = not config.gpt_model_use_experimental_version
        self.up_gate_proj = sublayers_spec.up_gate_proj(
            size, intermediate_size * 2 if config.gated_linear_unit else intermediate_size, config=config,
            init_method=config.init_method, gather_output=False, bias=config.use_bias, skip_bias_add=skip_bias_add,
            is_expert=is_expert, tp_group=tp_group, disable_fp8=disable_fp8)
        self.hidden_act = config.hidden_act
        self.down_proj = sublayers_spec.down_proj(
            intermediate_size, config.hidden_size if hidden_size is None else hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.use_bias, input_is_parallel=True,
            skip_bias_add=skip_bias_add, is_expert=is_expert, tp_group=tp_group, disable_fp8=disable_fp8)

    def forward(self, hidden_states, per_token_scale=None):
        intermediate, bias = self.up_gate_proj(hidden_states)
        if not self.config.bias_activation_fusion:
            raise AssertionError("stand-in: only the bias_activation_fusion branch is written")
        if per_token_scale is not None:
            intermediate = weighted_bias_swiglu_impl(intermediate, bias, per_token_scale.unsqueeze(-1), False,
                                                     self.config.activation_func_clamp_value,
                                                     use_accuracy_compatible=self.use_accuracy_compatible)
        else:
            intermediate = bias_swiglu_impl(intermediate, bias, fp8_input_store=False, cpu_offload_input=False,
                                            clamp_value=self.config.activation_func_clamp_value,
                                            use_accuracy_compatible=self.use_accuracy_compatible)
        return self.down_proj(intermediate)
