"""What the CPU engine and `pie bench` say about numpy's BLAS: the kernels OpenBLAS runs move its speed."""

from __future__ import annotations

from pie.bench import blas_kernels
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
    found = {d.what: d for d in EngineRegistry().engine_diagnosis("cpu")}
    assert found["BLAS"].ok
    for info in _blas():
        assert f"({info['architecture']} kernels, {info['num_threads']} threads)" in found["BLAS"].detail
