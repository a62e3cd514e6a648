"""numpy's BLAS as threadpoolctl sees it: which library, which kernel set, how many threads.

The kernel set OpenBLAS runs (``OPENBLAS_CORETYPE``, or its own pick for the CPU) moves the CPU
engine's batched projections by up to 1.4x, so benchmarks print it and `pie doctor` reports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def describe_blas_library(info: Mapping[str, Any]) -> str:
    """One threadpoolctl record as text, e.g. ``openblas 0.3.31 (Haswell kernels, 2 threads)``."""
    return (
        f"{info.get('internal_api')} {info.get('version')} "
        f"({info.get('architecture')} kernels, {info.get('num_threads')} threads)"
    )


def blas_kernels() -> str:
    """Every BLAS library numpy's process has loaded, described (see :func:`describe_blas_library`)."""
    import numpy  # noqa: F401  (loads numpy's BLAS, which threadpoolctl only sees once loaded)
    from threadpoolctl import threadpool_info

    found = [describe_blas_library(info) for info in threadpool_info() if info.get("user_api") == "blas"]
    return "; ".join(found) or "none reported"
