"""Pie: one LLM serving runtime shared by every engine."""

import os

# OpenBLAS's idle workers poll for their next call for 2^28 cycles (about 0.1 s here) before they
# sleep, taking CPU time from any other threads: kernels that run their own (the CPU engine's native
# ones) ran 1.35x slower for 0.1 s after every BLAS call. 2^22 cycles (about 1 ms) still covers the
# gaps between the BLAS calls of one forward pass. OpenBLAS reads this once, when numpy first loads
# it, so it takes effect when pie is imported before numpy; a value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "22")

from pie._version import __version__  # noqa: E402

__all__ = ["__version__"]
