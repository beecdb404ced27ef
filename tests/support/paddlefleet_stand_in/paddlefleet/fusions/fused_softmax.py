"""Stand-in for src/paddlefleet/fusions/fused_softmax.py@3ca20b50: FusedScaleMaskSoftmax's constructor and forward
signature; the causal mask made when none is given; softmax in fp32."""

import paddle

from paddlefleet import record
from paddlefleet.transformer.enums import AttnMaskType


class FusedScaleMaskSoftmax(paddle.nn.Layer):
    def __init__(self, input_in_fp16, input_in_bf16, attn_mask_type, scaled_masked_softmax_fusion, mask_func,
                 softmax_in_fp32, scale, sliding_window=None):
        super().__init__()
        record("paddlefleet.fusions.fused_softmax.FusedScaleMaskSoftmax", input_in_fp16=input_in_fp16,
               input_in_bf16=input_in_bf16, attn_mask_type=attn_mask_type, softmax_in_fp32=softmax_in_fp32)
        self.attn_mask_type, self.mask_func, self.softmax_in_fp32 = attn_mask_type, mask_func, softmax_in_fp32

    def forward(self, input, mask, softmax_offset=None):
        assert input.dim() == 4
        scores = input.astype("float32")
        if mask is None and self.attn_mask_type == AttnMaskType.causal:
            mask = paddle.triu(paddle.ones([input.shape[2], input.shape[3]]), diagonal=1).astype("bool")
        return paddle.nn.functional.softmax(self.mask_func(scores, mask), axis=-1).astype(input.dtype)
