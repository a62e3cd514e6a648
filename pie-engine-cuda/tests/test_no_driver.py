"""Without an NVIDIA driver the engine is listed as broken with a clear reason, and `pie doctor`
says what is missing and how to fix it. (On a machine with a driver these tests skip.)"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
from pie.plugins import EngineRegistry, EngineSelectionError, EngineSettingError
from pie_engine_cuda import plugin


def _driver_installed() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


needs_no_driver = pytest.mark.skipif(_driver_installed(), reason="an NVIDIA driver is installed on this machine")


@pytest.fixture
def auto_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIE_CUDA_BACKEND", raising=False)


def _registry() -> EngineRegistry:
    registry = EngineRegistry(autoload=False, env={})
    registry.register("cuda", plugin.engine, "pie-engine-cuda", "0.1.0")
    return registry


def test_engine_info_and_listing_import_no_backend_library() -> None:
    script = (
        "import sys\n"
        "from pie.plugins import EngineRegistry\n"
        "status = EngineRegistry(env={}).status('cuda')\n"
        "assert status.info is not None and status.info.priority == 100, status\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('cuda', 'hip', 'rocm')]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


@needs_no_driver
def test_probe_raises_naming_the_missing_driver(auto_backend: None) -> None:
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1 was not found") as caught:
        plugin.engine.pie_probe_devices()
    assert "nvidia-driver" in str(caught.value)


@needs_no_driver
def test_the_engine_is_listed_as_broken_with_that_reason(auto_backend: None) -> None:
    registry = _registry()
    status = registry.status("cuda")
    assert status.status == "broken"
    assert "libcuda.so.1" in status.reason and "device probe failed" in status.reason
    with pytest.raises(EngineSelectionError, match="libcuda.so.1"):
        registry.select("cuda")


@needs_no_driver
def test_the_installed_entry_point_reports_the_same(auto_backend: None) -> None:
    status = EngineRegistry(env={}).status("cuda")
    assert status.distribution == "pie-engine-cuda"
    assert status.status == "broken" and "libcuda.so.1" in status.reason


@needs_no_driver
def test_doctor_names_the_driver_with_a_fix(auto_backend: None) -> None:
    findings = {d.what: d for d in plugin.engine.pie_diagnose()}
    driver = findings["NVIDIA driver (libcuda.so.1)"]
    assert not driver.ok and "not found" in driver.detail
    assert "nvidia-driver" in driver.fix and "--gpus all" in driver.fix
    assert findings["cuda-python"].ok
    assert findings["NVRTC"].ok, findings["NVRTC"].detail
    assert all(d.fix for d in findings.values() if not d.ok)


def test_a_driver_without_gpus_means_no_device(auto_backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import driver
    from pie_engine_cuda import backend, driver_api

    monkeypatch.setattr(driver_api, "init_driver", lambda d: driver.CUresult.CUDA_ERROR_NO_DEVICE)
    monkeypatch.setattr(backend, "hip_python_installed", lambda: False)
    assert plugin.engine.pie_probe_devices() == []
    assert _registry().status("cuda").status == "no-device"


def test_an_unknown_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_CUDA_BACKEND", "metal")
    with pytest.raises(EngineSettingError, match="PIE_CUDA_BACKEND='metal' is not one of cuda, hip, nor module:attribute of a backend"):
        plugin.engine.pie_probe_devices()
    (finding,) = plugin.engine.pie_diagnose()
    assert not finding.ok and "PIE_CUDA_BACKEND" in finding.fix


def test_an_unknown_weight_dtype_is_the_users_setting_read_by_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # Was read only when a device opened, as "weight dtype must be one of ...", the variable unnamed.
    monkeypatch.setenv("PIE_CUDA_WEIGHT_DTYPE", "int4")
    with pytest.raises(EngineSettingError, match="PIE_CUDA_WEIGHT_DTYPE is 'int4'; expected one of float32, float16"):
        plugin.engine.pie_probe_devices()


def test_forcing_hip_without_an_amd_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("hip", reason="hip-python is not installed")
    from pie_engine_cuda.driver_api import probe_hip

    monkeypatch.setenv("PIE_CUDA_BACKEND", "hip")
    try:
        devices = probe_hip()
    except RuntimeError as exc:  # no HIP runtime at all: the message must say how to get one
        assert "ROCm" in str(exc) or "hip" in str(exc).lower()
        return
    if devices:
        pytest.skip("an AMD GPU is present")
    assert _registry().status("cuda").status == "no-device"
    findings = {d.what: d for d in plugin.engine.pie_diagnose()}
    assert findings["hiprtc"].ok, findings["hiprtc"].detail
    assert not findings["AMD GPU"].ok and "render" in findings["AMD GPU"].fix


@needs_no_driver
def test_auto_selection_reports_both_backends_when_hip_python_is_installed(auto_backend: None) -> None:
    pytest.importorskip("hip", reason="hip-python is not installed")
    with pytest.raises(RuntimeError, match="for AMD GPUs"):
        plugin.engine.pie_probe_devices()
