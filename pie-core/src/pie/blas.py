"""numpy's BLAS as threadpoolctl sees it: which library, which kernel set, how many threads.

The kernel set OpenBLAS runs (``OPENBLAS_CORETYPE``, or its own pick for the CPU) moves the CPU
engine's batched projections markedly, so benchmarks print it and `pie doctor` reports it, with
the fix where it is narrower than the CPU (:func:`blas_kernel_advice`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
"""The AVX-512 extensions OpenBLAS's AVX-512 (SkylakeX family) kernels need."""
OPENBLAS_AVX512_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
"""OpenBLAS core types whose single-precision kernels use AVX-512."""


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


def blas_kernel_advice(architecture: str, flags: frozenset[str], coretype: str | None) -> tuple[str, str] | None:
    """(problem, fix) when OpenBLAS runs kernels narrower than the CPU's AVX-512, else None.

    ``coretype`` is ``OPENBLAS_CORETYPE`` when set: it overrides OpenBLAS's own choice
    (``docs/perf-notes.md`` has what the narrower kernels cost).
    """
    if not AVX512_FLAGS <= flags or architecture.lower() in OPENBLAS_AVX512_CORES:
        return None
    if coretype:
        return (
            f"OPENBLAS_CORETYPE={coretype} holds OpenBLAS to its {architecture} kernels on a CPU with AVX-512",
            "unset OPENBLAS_CORETYPE",
        )
    return (
        f"OpenBLAS does not recognise this CPU and runs its {architecture} kernels although it has AVX-512",
        "export OPENBLAS_CORETYPE=SkylakeX",
    )
