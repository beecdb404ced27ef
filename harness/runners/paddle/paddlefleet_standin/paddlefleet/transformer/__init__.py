"""Stand-in (see paddlefleet/__init__.py)."""
