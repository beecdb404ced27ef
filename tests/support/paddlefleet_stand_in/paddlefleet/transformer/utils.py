"""Stand-in for ``paddlefleet.transformer.utils`` (attention_mask_func: fill the masked scores with -10000)."""

from paddlefleet import record


def attention_mask_func(attention_scores, attention_mask):
    record("paddlefleet.transformer.utils.attention_mask_func")
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores
