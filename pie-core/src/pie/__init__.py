"""Pie: one LLM serving runtime shared by every engine."""

import os

# OpenBLAS's idle workers poll for their next call for 2^28 cycles (about 0.1 s here) before they
# sleep, taking CPU time from any other threads: kernels that run their own (the CPU engine's native
# ones) ran 1.35x slower for 0.1 s after every BLAS call, and a batch-8 decode step that mixes both
# 1.25x slower even at 2^22. At 2^18 cycles (about 70 us) all-BLAS steps (batch 32, prefill) measured
# the same as at 2^28. OpenBLAS reads this once, when numpy first loads it, so it takes effect when pie
# is imported before numpy; a value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

from pie._version import __version__  # noqa: E402

__all__ = ["__version__"]
