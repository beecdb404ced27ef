"""Test double: a stand-in for PaddleFleet (tests/support/paddlefleet_stand_in/README.md); records every call."""

__version__ = "stand-in (test double)"
CALLS: list[tuple[str, dict]] = []


def record(name: str, **arguments) -> None:
    CALLS.append((name, arguments))
