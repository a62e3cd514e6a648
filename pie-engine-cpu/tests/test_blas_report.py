"""What the CPU engine and `pie bench` say about numpy's BLAS: the kernels OpenBLAS runs move its speed."""

from __future__ import annotations

from pie.blas import blas_kernel_advice, blas_kernels
from pie.plugins import EngineRegistry
from threadpoolctl import threadpool_info


def _blas() -> list[dict]:
    return [info for info in threadpool_info() if info.get("user_api") == "blas"]


def test_bench_names_the_blas_kernels_and_threads() -> None:
    text = blas_kernels()
    assert _blas(), "numpy should load a BLAS"
    for info in _blas():
        assert f"{info['architecture']} kernels, {info['num_threads']} threads" in text
        assert str(info["version"]) in text


def test_diagnosis_reports_the_blas_kernels() -> None:
    found = {d.what: d for d in EngineRegistry().diagnoses(["cpu"])["cpu"]}
    assert found["BLAS"].ok
    for info in _blas():
        assert f"({info['architecture']} kernels, {info['num_threads']} threads)" in found["BLAS"].detail


AVX512_CPU = frozenset({"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})
AVX2_CPU = frozenset({"sse4_2", "avx2", "fma"})


def test_avx2_kernels_on_an_avx512_cpu_are_flagged_with_the_fix() -> None:
    problem, fix = blas_kernel_advice("Haswell", AVX512_CPU, "Haswell")
    assert "OPENBLAS_CORETYPE=Haswell" in problem and fix == "unset OPENBLAS_CORETYPE"
    problem, fix = blas_kernel_advice("Haswell", AVX512_CPU, None)
    assert "does not recognise this CPU" in problem and fix == "export OPENBLAS_CORETYPE=SkylakeX"


def test_matching_kernels_need_no_advice() -> None:
    assert blas_kernel_advice("SkylakeX", AVX512_CPU, None) is None
    assert blas_kernel_advice("Cooperlake", AVX512_CPU, "Cooperlake") is None
    assert blas_kernel_advice("Haswell", AVX2_CPU, None) is None
    assert blas_kernel_advice("Haswell", frozenset(), None) is None
