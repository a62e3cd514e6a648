"""Pie engine for XLA: each Poem region becomes one JAX function, lowered to StableHLO and run by PJRT."""

from pie_engine_xla._version import __version__

__all__ = ["__version__"]
