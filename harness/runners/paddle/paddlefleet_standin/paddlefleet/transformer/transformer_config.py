"""Stand-in (see paddlefleet/__init__.py): gpt_provider.py's fallback base when gpt_config has no GPTConfig."""


class TransformerConfig:
    """Never used here (models/gpt/gpt_config.py has GPTConfig)."""

    transform_rules: dict = {}
