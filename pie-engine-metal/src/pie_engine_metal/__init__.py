"""Pie engine for Metal: hand-written MSL kernels through PyObjC."""

from pie_engine_metal._version import __version__

__all__ = ["__version__"]
