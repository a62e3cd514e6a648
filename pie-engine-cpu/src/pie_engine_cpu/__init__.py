"""Pie's CPU engine: numpy kernels and the host-RAM page pool."""

from pie_engine_cpu._version import __version__

__all__ = ["__version__"]
