"""Stand-in (see paddlefleet/__init__.py): the bound of a TypeVar in paddleformers/transformers/model_provider.py."""

from paddlefleet import Placeholder


class FleetLayer(Placeholder):
    """Only a TypeVar's bound; never constructed here."""
