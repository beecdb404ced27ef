"""Bitwise differential testing of one layer run by two frameworks on the same bits."""

__version__ = "0.1.0"
