"""Stand-in for ``paddlefleet.tensor_parallel`` (src/paddlefleet/tensor_parallel/layers.py@021152f8:
VocabParallelEmbedding's signature, and ``Linear``'s, whose docstring says its interface is ColumnParallelLinear's;
RowParallelLinear's keyword arguments as the project's notes read them from that file and as mlp.py@9f9bd7b9 passes
them). Weights are [in, out]; forward returns (output, bias or None)."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from paddlefleet import record


class _Linear(paddle.nn.Layer):
    def __init__(self, name, input_size, output_size, config, bias, skip_bias_add, arguments):
        super().__init__()
        record(f"paddlefleet.tensor_parallel.{name}", input_size=input_size, output_size=output_size, config=config,
               bias=bias, **arguments)
        self.skip_bias_add = skip_bias_add
        self.weight = self.create_parameter([input_size, output_size], dtype=config.params_dtype)  # [in, out]
        self.bias = self.create_parameter([output_size], dtype=config.params_dtype, is_bias=True) if bias else None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        out = F.linear(input_, self.weight if weight is None else weight, None if self.skip_bias_add else self.bias)
        return out, self.bias if self.skip_bias_add else None


class ColumnParallelLinear(_Linear):
    def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False, stride=1,
                 keep_master_weight_for_test=False, skip_bias_add=False, skip_weight_param_allocation=False,
                 embedding_activation_buffer=None, grad_output_buffer=None, is_expert=False, tp_comm_buffer_name=None,
                 disable_grad_reduce=False, tp_group=None, disable_fp8=False):
        super().__init__("ColumnParallelLinear", input_size, output_size, config, bias, skip_bias_add,
                         {"gather_output": gather_output, "is_expert": is_expert, "tp_group": tp_group})


class RowParallelLinear(_Linear):
    def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                 stride=1, keep_master_weight_for_test=False, is_expert=False, tp_comm_buffer_name=None, tp_group=None,
                 disable_fp8=False):
        super().__init__("RowParallelLinear", input_size, output_size, config, bias, skip_bias_add,
                         {"input_is_parallel": input_is_parallel, "is_expert": is_expert, "tp_group": tp_group})


class VocabParallelEmbedding(paddle.nn.Layer):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method, reduce_scatter_embeddings=False,
                 config, tp_group=None):
        super().__init__()
        record("paddlefleet.tensor_parallel.VocabParallelEmbedding", num_embeddings=num_embeddings,
               embedding_dim=embedding_dim, config=config, reduce_scatter_embeddings=reduce_scatter_embeddings)
        self.config = config
        self.weight = self.create_parameter([num_embeddings, embedding_dim], dtype=config.params_dtype)

    def forward(self, input_):
        if getattr(self.config, "deterministic_mode", False) or self.config.use_accuracy_compatible:
            return self.weight[input_]
        return F.embedding(input_, self.weight)
