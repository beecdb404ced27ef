"""Stand-in for ``paddlefleet.transformer.enums``."""

import enum


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
