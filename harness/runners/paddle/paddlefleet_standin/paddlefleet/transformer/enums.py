"""Stand-in (see paddlefleet/__init__.py): paddleformers/transformers/model_provider.py imports ModelType."""

import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
