"""Stand-in (see paddlefleet/__init__.py): paddleformers/transformers/model_provider.py imports get_model_config."""

from paddlefleet import refuse

get_model_config = refuse("paddlefleet.utils.get_model_config")
