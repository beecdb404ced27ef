"""DeepSeek Sparse Attention (GLM-5's attention: MLA with DSA's indexer) on Megatron-Core >= 0.19 without Transformer
Engine: the local block spec the harness writes where Megatron's own asserts TE.

megatron-core 0.19.2's DSA spec (``models/gpt/experimental_attention_variant_module_specs.py``:
``get_transformer_block_with_experimental_attention_variant_spec``) asserts ``transformer_impl ==
"transformer_engine"`` and takes ``TESpecProvider``; its layer builder
(``get_transformer_layer_with_experimental_attention_variant_spec``) takes any backend, but the DSA attention asks
it for ``linear()`` (the indexer's ``linear_wq_b``, ``linear_wk``, ``linear_weights_proj``, built with
``parallel_mode="duplicated"``; ``AbsorbedMLASelfAttention``'s ``linear_q_down_proj`` / ``linear_kv_down_proj``),
which ``LocalSpecProvider`` has not. ``LocalDSASpecProvider`` adds it: Megatron's own local ``Linear``
(``megatron.core.post_training.modelopt.layers.Linear``, "Local Linear impl as a replacement of ParallelLinear":
``torch.nn.Linear``, the one non-TE class that takes ``parallel_mode="duplicated"``). ``AbsorbedMLASelfAttention``
accepts that class for its down projections only when Transformer Engine is installed (it imports ``Linear`` under
``HAVE_TE``), so ``block_spec`` gives them ``ColumnParallelLinear``, as Megatron's own local MLA spec does
(``gpt_layer_specs.get_gpt_layer_local_spec``); at tensor-parallel size 1 (the only size built here) both are one
GEMM of the input by the weight. Every other submodule is the provider's, as Megatron builds it (the local
norms, ColumnParallelLinear / RowParallelLinear, SequentialMLP): the DSA core attention (``DSAttention``,
``DSAIndexer``) is Megatron's local code for any backend.
"""

from __future__ import annotations

from harness.run.cell_state import patch
from harness.run.protocol import Unsupported

# The TransformerConfig fields the harness sets; megatron-core 0.16.1's DSA has none of the three switches.
SWITCHES = ("dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon")


def require() -> None:
    """UNSUPPORTED unless the installed megatron-core's DSA can switch its Hadamard rotation off (0.19)."""
    from dataclasses import fields
    from importlib.metadata import version

    from megatron.core.transformer.transformer_config import TransformerConfig

    have = {f.name for f in fields(TransformerConfig)}
    missing = [name for name in SWITCHES if name not in have]
    if missing:
        raise Unsupported(
            f"DeepSeek Sparse Attention's indexer needs megatron-core >= 0.19 (0.19.2's DSA with its Hadamard "
            f"rotation off, dsa_indexer_rotate_activation=False, as Megatron Bridge's GLM-5 sets it): "
            f"megatron-core {version('megatron-core')} has no {', '.join(missing)} (its indexer always applies "
            "rotate_activation, which needs the fast_hadamard_transform CUDA extension and bf16)")


def provider():
    """A ``LocalSpecProvider`` with ``linear()``: Megatron's local ``Linear`` (see the module docstring)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.post_training.modelopt.layers import Linear

    class LocalDSASpecProvider(LocalSpecProvider):
        """Megatron-Core's local backend plus the ``linear()`` DSA asks for."""

        def linear(self) -> type:
            return Linear

    return LocalDSASpecProvider()


def block_spec(config, layer_norm):
    """The decoder block: Megatron's per-layer DSA specs from the local provider (the down projections as in
    Megatron's local MLA spec), `layer_norm` the final norm."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=provider())
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = ColumnParallelLinear
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=layer_norm)


def selected(indices):
    """The contract's ``indexer.selected`` from DSAIndexer's output, the first sequence's top-k key indices
    ``[b, s, k]`` (-1 where the key was masked): ``[T, T]`` int64, 1 where key j is among query i's and j <= i (the
    HF room's recorder cuts HF's masked picks by the same causal rule)."""
    import torch

    first = indices[0].detach().to(torch.int64)
    tokens = first.shape[0]
    chosen = torch.zeros(tokens, tokens + 1, dtype=torch.int64, device=first.device)  # column T: the -1s
    chosen.scatter_(1, torch.where(first < 0, tokens, first), 1)
    return torch.tril(chosen[:, :tokens])


def record_topk() -> list:
    """The top-k key indices of every DSA layer, in the order the forward computes them (layer by layer): DSAttention
    calls its indexer's methods, not the module, so no forward hook sees them; the module-level
    ``fused_qk_topk_naive`` it calls is wrapped for this cell (``harness.run.cell_state.patch``) by an observer that
    keeps a copy of its second output and returns both unchanged."""
    from megatron.core.transformer.experimental_attention_variant import dsa as megatron_dsa

    kept, compute = [], megatron_dsa.fused_qk_topk_naive

    def observed(*args, **kwargs):
        scores, indices = compute(*args, **kwargs)
        kept.append(indices.detach().clone())
        return scores, indices

    patch(megatron_dsa, "fused_qk_topk_naive", observed)
    return kept
