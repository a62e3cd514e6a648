"""Pie: one LLM serving runtime shared by every engine."""

import os

# OpenBLAS's idle workers poll for their next call for 2^28 cycles before they sleep, taking CPU
# time from any other threads: kernels that run their own (the CPU engine's native ones) ran slower
# for that long after every BLAS call, and a batch-8 decode step that mixes both was slower even at
# 2^22. At 2^18 cycles all-BLAS steps (batch 32, prefill) measured the same as at 2^28. OpenBLAS
# reads this once, when numpy first loads it, so it takes effect when pie is imported before numpy; a
# value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

from pie._version import __version__  # noqa: E402

__all__ = ["__version__"]
