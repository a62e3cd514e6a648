"""Pie engine for WebGPU: the kernels of :mod:`pie.enginekit.shaders` as WGSL, run through wgpu-py."""

from pie_engine_wgpu._version import __version__

__all__ = ["__version__"]
