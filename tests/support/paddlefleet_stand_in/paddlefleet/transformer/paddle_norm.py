"""Stand-in for src/paddlefleet/transformer/paddle_norm.py@0534a451: WrappedPaddleNorm builds RMSNorm (weight in the
default dtype); its forward here is a plain fp32 RMSNorm (the real one calls fused_rms_norm_ext, a GPU kernel)."""

import paddle

from paddlefleet import record


class RMSNorm(paddle.nn.Layer):
    def __init__(self, config, normalized_shape=None, norm_eps=None, input_is_parallel=False, **kwargs):
        super().__init__()
        record("paddlefleet.transformer.paddle_norm.RMSNorm", normalized_shape=normalized_shape, norm_eps=norm_eps)
        self.variance_epsilon = norm_eps
        self.weight = paddle.create_parameter(shape=[normalized_shape], dtype=paddle.get_default_dtype(),
                                              default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, hidden_states):
        x = hidden_states.astype("float32")
        normed = x * paddle.rsqrt(x.pow(2).mean(axis=-1, keepdim=True) + self.variance_epsilon)
        return (normed * self.weight.astype("float32")).astype(self.weight.dtype)


class WrappedPaddleNorm:
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, input_is_parallel: bool = False):
        record("paddlefleet.transformer.paddle_norm.WrappedPaddleNorm", config=config, hidden_size=hidden_size, eps=eps)
        if config.normalization != "RMSNorm":
            raise Exception("Only RMSNorm for now.")
        return RMSNorm(config=config, normalized_shape=hidden_size, norm_eps=eps, input_is_parallel=input_is_parallel)
