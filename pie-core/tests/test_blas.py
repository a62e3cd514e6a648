"""`pie doctor`'s BLAS findings: only an OpenBLAS that runs kernels narrower than the CPU's is a problem."""

from __future__ import annotations

import pytest
from pie import blas

AVX512_CPU = frozenset({"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})
HASWELL = {"internal_api": "openblas", "architecture": "Haswell"}


def test_only_an_openblas_with_narrower_kernels_than_the_cpu_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "cpu_flags", lambda: AVX512_CPU)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    [(problem, fix)] = blas.blas_kernel_problems([HASWELL, {"internal_api": "mkl", "architecture": "Haswell"}])
    assert "does not recognise this CPU" in problem and fix == "export OPENBLAS_CORETYPE=SkylakeX"
    assert blas.blas_kernel_problems([{**HASWELL, "architecture": "SkylakeX"}]) == []
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    [(problem, fix)] = blas.blas_kernel_problems([HASWELL])
    assert "OPENBLAS_CORETYPE=Haswell" in problem and fix == "unset OPENBLAS_CORETYPE"
    monkeypatch.setattr(blas, "cpu_flags", lambda: frozenset({"avx2"}))
    assert blas.blas_kernel_problems([HASWELL]) == []


def test_the_libraries_are_numpys_blas() -> None:
    assert all(info["user_api"] == "blas" for info in blas.blas_libraries())
