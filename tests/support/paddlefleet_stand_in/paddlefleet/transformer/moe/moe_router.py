"""Stand-in for src/paddlefleet/transformer/moe/moe_router.py@01ae3ccf: TopKRouter(config, pg_collection=None) with its
weight [experts, hidden] (params dtype under the gate, else fp32) and e_score_correction_bias [experts];
forward(input, input_ids=None, origin_input_ids=None) returns its 8-tuple (probs at 3, top_idx at 2). The arithmetic
is a plain fp32 sigmoid top-k."""

import paddle
import paddle.nn.functional as F

from paddlefleet import record


class TopKRouter(paddle.nn.Layer):
    def __init__(self, config, pg_collection=None):
        super().__init__()
        record("paddlefleet.transformer.moe.moe_router.TopKRouter", config=config)
        self.config = config
        dtype = config.params_dtype if config.use_accuracy_compatible else "float32"
        self.weight = paddle.create_parameter([config.n_routed_experts, config.hidden_size], dtype=dtype)
        self.register_buffer("e_score_correction_bias", paddle.zeros([config.n_routed_experts], dtype="float32"))

    def forward(self, input, input_ids=None, origin_input_ids=None):
        x = input.reshape([-1, input.shape[-1]]).astype("float32")
        scores = F.sigmoid(F.linear(x, self.weight.T.astype("float32")))
        _, top_idx = paddle.topk(scores + self.e_score_correction_bias, self.config.num_experts_per_tok, axis=-1)
        top_gate = paddle.take_along_axis(scores, top_idx, axis=1)
        top_gate = top_gate / top_gate.sum(axis=-1, keepdim=True) * self.config.routed_scaling_factor
        probs = paddle.zeros_like(scores).put_along_axis(top_idx, top_gate, axis=1)
        return None, top_gate, top_idx, probs, (probs > 0).astype("float32"), None, None, None
