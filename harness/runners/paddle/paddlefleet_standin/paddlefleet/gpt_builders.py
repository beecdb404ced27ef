"""Stand-in (see paddlefleet/__init__.py): paddleformers/transformers/gpt_provider.py imports gpt_builder."""

from paddlefleet import refuse

gpt_builder = refuse("paddlefleet.gpt_builders.gpt_builder")
