"""Qwen3.5-MoE's Gated DeltaNet layers on Megatron-Core >= 0.19 without Transformer Engine: the local block spec the
harness writes where Megatron's own hybrid spec asserts TE.

megatron-core 0.19.2's hybrid block (``models/gpt/experimental_attention_variant_module_specs.py``:
``get_transformer_block_with_experimental_attention_variant_spec``) asserts ``transformer_impl ==
"transformer_engine"``, and its layer builder takes the standard attention from the TE layer spec
(``_get_self_attention_module_spec``). ``block_spec`` builds instead:

- every layer: Megatron's local GPT layer spec (``gpt_layer_specs.get_gpt_decoder_layer_specs`` with
  ``use_transformer_engine=False``, on the config without its experimental variant, which that function refuses;
  the same MoE, attention and norms): ``SelfAttention`` with the output gate (``attention_output_gate``) and per-head
  q/k norms, ``MoELayer`` with the shared expert behind its gate, ``WrappedTorchNorm`` norms;
- a linear-attention layer (``get_linear_attention_pattern``): its ``self_attention`` is Megatron's own
  ``get_gated_delta_net_module_spec(config, backend=LocalSpecProvider())`` (``GatedDeltaNet``, the local out_norm and
  ``RowParallelLinear`` out_proj), but ``in_proj``: the spec asks ``column_parallel_layer_norm_linear()`` (TE's
  fused norm + linear; the local provider answers None) and drops the layer's input norm (``fuse_input_layernorm``).
  The harness keeps the layer's ``input_layernorm`` (the local norm, as for every other layer) and gives ``in_proj``
  ``ColumnParallelLinear``: the same norm, then the same GEMM, unfused.

``GatedDeltaNet`` constructs only where flash-linear-attention imports (``HAVE_FLA``). With ``deterministic_mode``
(translate_config sets it) it takes torch paths for the causal conv (``F.conv1d``) and the delta rule
(``torch_chunk_gated_delta_rule``); fla's ``l2norm`` (a Triton kernel) stays, so the layer runs on a GPU only.
"""

from __future__ import annotations

from harness.run.protocol import Unsupported


def require() -> None:
    """UNSUPPORTED unless flash-linear-attention imports and megatron-core has GatedDeltaNet (>= 0.19), naming
    what is missing."""
    import importlib.util
    from importlib.metadata import version

    megatron = version("megatron-core")
    try:  # 0.19's package; 0.16's gated_delta_net is one module, with another in_proj layout (not mapped)
        has_gdn = importlib.util.find_spec("megatron.core.ssm.gated_delta_net.common") is not None
    except ModuleNotFoundError:
        has_gdn = False
    if has_gdn:
        from megatron.core.ssm.gated_delta_net import common

        has_fla = common.HAVE_FLA
    else:
        has_fla = importlib.util.find_spec("fla") is not None
    missing = [] if has_fla else [
        "flash-linear-attention (package flash-linear-attention, module fla, with triton: GatedDeltaNet raises "
        "ImportError without it, and its l2norm is a Triton kernel, a GPU)"]
    missing += [] if has_gdn else [f"megatron-core >= 0.19 (GatedDeltaNet's in_proj as the name map lays it out, "
                                   f"megatron.core.ssm.gated_delta_net.common; megatron-core {megatron}'s is not "
                                   "mapped)"]
    if missing:
        raise Unsupported(f"Gated DeltaNet layers need {' and '.join(missing)}")


def block_spec(config, layer_norm):
    """The decoder block (see the module docstring), `layer_norm` the final norm."""
    from dataclasses import replace

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
        get_linear_attention_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    standard = replace(config, experimental_attention_variant=None, linear_attention_freq=None)
    layers = get_gpt_decoder_layer_specs(standard, use_transformer_engine=False, normalization="RMSNorm")
    attention = get_gated_delta_net_module_spec(config, backend=LocalSpecProvider())
    attention.submodules.in_proj = ColumnParallelLinear
    layers = [replace(layer, submodules=replace(layer.submodules, self_attention=attention)) if linear else layer
              for layer, linear in zip(layers, get_linear_attention_pattern(config), strict=True)]  # specs shared
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=layer_norm)


def gated_head_rows(model):
    """names.toml ``gated_rows`` (q_proj of an output-gated attention): Megatron's row r of q_proj is HF's row
    ``perm[r]``. HF's q_proj gives each head its query then its gate; Megatron's linear_qkv gives each query group its
    heads' queries, then their gates (``SelfAttention.get_query_key_value_tensors``, output_gate), then k and v.
    HF's order back: ``argsort(perm)``."""
    import torch

    attention = model.record.architecture(model).attention
    per_group, size = attention.heads // attention.kv_heads, attention.head_dim
    return torch.tensor([(group * per_group + head) * 2 * size + part * size + d
                         for group in range(attention.kv_heads) for part in (0, 1)
                         for head in range(per_group) for d in range(size)])


def versions(model) -> dict:
    """meta.json's versions of the packages a GDN layer runs on (fla's l2norm, a Triton kernel); none without one."""
    from importlib.metadata import version

    if model.record.architecture(model).linear_attention is None:
        return {}
    return {name: version(name) for name in ("flash-linear-attention", "fla-core", "triton")}
