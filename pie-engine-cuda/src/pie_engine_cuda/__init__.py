"""Pie's CUDA engine: CUDA C kernels compiled at run time by NVRTC (or hiprtc on AMD GPUs)."""

from pie_engine_cuda._version import __version__

__all__ = ["__version__"]
