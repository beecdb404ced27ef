"""Stand-in (see paddlefleet/__init__.py): paddleformers/transformers/gpt_provider.py subclasses GPTModel."""

from paddlefleet import Placeholder


class GPTModel(Placeholder):
    """Subclassed by paddleformers' gpt_provider.GPTModel (the PaddleFleet path); never constructed here."""
