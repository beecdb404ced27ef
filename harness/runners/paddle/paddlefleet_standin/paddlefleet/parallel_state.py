"""Stand-in (see paddlefleet/__init__.py): imported by paddleformers/transformers/model_provider.py, never used."""
