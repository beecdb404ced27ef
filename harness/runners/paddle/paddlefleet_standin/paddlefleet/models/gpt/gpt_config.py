"""Stand-in (see paddlefleet/__init__.py): the base of paddleformers' GPTModelProvider dataclass."""


class GPTConfig:
    """PaddleFormers' model modules read ``GPTModelProvider.transform_rules`` while defining their providers
    (``{**GPTModelProvider.transform_rules, ...}``): an empty table; nothing else."""

    transform_rules: dict = {}
