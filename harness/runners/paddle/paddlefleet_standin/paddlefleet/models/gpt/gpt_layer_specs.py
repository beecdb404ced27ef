"""Stand-in (see paddlefleet/__init__.py): paddleformers/transformers/gpt_provider.py imports these."""

from paddlefleet import refuse

get_gpt_layer_local_spec = refuse("paddlefleet.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec")
get_gpt_mtp_block_spec = refuse("paddlefleet.models.gpt.gpt_layer_specs.get_gpt_mtp_block_spec")
