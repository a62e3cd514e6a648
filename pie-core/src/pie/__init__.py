"""Pie: one LLM serving runtime shared by every engine."""

from pie._version import __version__

__all__ = ["__version__"]
