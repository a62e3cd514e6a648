"""numpy's BLAS as threadpoolctl sees it: which library, which kernel set, how many threads.

The kernel set OpenBLAS runs (``OPENBLAS_CORETYPE``, or its own pick for the CPU) moves the CPU
engine's batched projections markedly, so benchmarks print it and `pie doctor` reports it, with
the fix where it is narrower than the CPU (:func:`blas_kernel_advice`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pie.enginekit.host import cpu_flags

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


def blas_libraries() -> list[dict[str, Any]]:
    """threadpoolctl's record of every BLAS library numpy's process has loaded."""
    import numpy  # noqa: F401  (loads numpy's BLAS, which threadpoolctl only sees once loaded)
    from threadpoolctl import threadpool_info

    return [info for info in threadpool_info() if info.get("user_api") == "blas"]


def blas_kernels() -> str:
    """Every BLAS library numpy's process has loaded, described (see :func:`describe_blas_library`)."""
    return "; ".join(map(describe_blas_library, blas_libraries())) or "none reported"


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


def blas_kernel_problems(libraries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(problem, fix) for each OpenBLAS among ``libraries`` (:func:`blas_libraries`) that runs kernels narrower
    than this host's CPU (:func:`blas_kernel_advice`, with its flags and ``OPENBLAS_CORETYPE``)."""
    flags, coretype = cpu_flags(), os.environ.get("OPENBLAS_CORETYPE")
    advice = (blas_kernel_advice(str(info.get("architecture")), flags, coretype) for info in libraries
              if info.get("internal_api") == "openblas")
    return [found for found in advice if found is not None]
