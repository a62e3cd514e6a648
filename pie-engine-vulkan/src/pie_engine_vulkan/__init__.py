"""Pie engine for Vulkan: the kernels of :mod:`pie.enginekit.shaders` as SPIR-V, run through the vulkan package."""

from pie_engine_vulkan._version import __version__

__all__ = ["__version__"]
