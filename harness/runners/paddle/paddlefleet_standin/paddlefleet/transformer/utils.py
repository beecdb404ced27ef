"""Stand-in (see paddlefleet/__init__.py): paddleformers/transformers/minimax_m2/modeling.py imports it (that
module has no dygraph class: its model is PaddleFleet's)."""

from paddlefleet import refuse

is_layer_window_attention = refuse("paddlefleet.transformer.utils.is_layer_window_attention")
