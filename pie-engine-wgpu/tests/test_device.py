"""Adapter probing, selection, diagnosis and engine description of the WebGPU engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pie.contract import KernelRequest
from pie.enginekit.host import may_have_hardware_gpu
from pie.plugins import EngineRegistry
from pie_engine_wgpu.plugin import PRIORITY, SOFTWARE_ONLY_PRIORITY

STATUS = (
    "from pie.plugins import EngineRegistry; s = EngineRegistry().status('wgpu');"
    "print(s.status, '|', s.devices[0].name if s.devices else s.reason)"
)


def run_python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (the adapter list is per process)."""
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip().splitlines()[-1]


def test_probe_shows_lavapipe_through_vulkan() -> None:
    devices = EngineRegistry().status("wgpu").devices
    lavapipe = [d for d in devices if d.name.startswith("llvmpipe")]
    assert lavapipe, f"lavapipe (mesa-vulkan-drivers) not found among {[d.name for d in devices]}"
    assert lavapipe[0].kind == "cpu" and lavapipe[0].vendor == "Mesa"
    assert dict(lavapipe[0].extra)["backend"] == "Vulkan", "only native compute backends are used, not OpenGL"


def test_engine_info_imports_no_wgpu_and_ranks_software_devices_below_cpu() -> None:
    code = "import sys, pie_engine_wgpu.plugin as p; print(p.engine.pie_engine_info().priority, 'wgpu' in sys.modules)"
    priority, imported = run_python(code).split()
    assert imported == "False"
    assert int(priority) == (PRIORITY if may_have_hardware_gpu() else SOFTWARE_ONLY_PRIORITY)


def test_adapter_override_by_name_or_index_and_clear_errors() -> None:
    first = EngineRegistry().status("wgpu").devices[0].name
    assert run_python(STATUS, PIE_WGPU_DEVICE="LLVMPIPE").startswith("ok | llvmpipe")
    assert run_python(STATUS, PIE_WGPU_DEVICE="0") == f"ok | {first}"
    assert "matches no adapter" in run_python(STATUS, PIE_WGPU_DEVICE="no-such-gpu")
    assert "PIE_WGPU_DEVICE=99: only" in run_python(STATUS, PIE_WGPU_DEVICE="99")


def test_diagnose_lists_the_adapter() -> None:
    found = EngineRegistry().diagnoses(["wgpu"])["wgpu"]
    native = [d for d in found if d.what != "browser"]  # the browser device's finding: test_browser_device.py
    assert all(d.ok for d in native), found
    assert "llvmpipe" in next(d for d in native if d.what == "adapters").detail


def test_diagnose_without_a_vulkan_driver_says_what_to_install() -> None:
    code = (
        "import json; from pie.plugins import EngineRegistry; r = EngineRegistry(); found = r.diagnoses(['wgpu'])['wgpu'];"
        "print(json.dumps([r.status('wgpu').status, [[d.ok, d.what, d.detail, d.fix] for d in found]]))"
    )
    nowhere = "/nonexistent/pie_icd.json"
    # Without the browser device, which would be the engine's only one then.
    env = {"VK_ICD_FILENAMES": nowhere, "VK_DRIVER_FILES": nowhere, "PIE_WGPU_BROWSER": "off"}
    status, found = json.loads(run_python(code, **env))
    assert status != "ok"
    failing = [item for item in found if not item[0]]
    assert failing, found
    _, what, detail, fix = failing[0]
    assert what == "adapters" and "no Vulkan/Metal/D3D12 adapter" in detail
    if sys.platform.startswith("linux"):
        assert "apt-get install libvulkan1 mesa-vulkan-drivers" in fix


def test_kernel_source_is_the_shipped_wgsl() -> None:
    device = EngineRegistry().engine("wgpu").open(0)
    source = device.source(KernelRequest("rms_norm_linear"))
    assert source is not None and "fn rms_norm_linear__rows(" in source and "@compute" in source


def test_synchronize_waits_for_queued_launches() -> None:
    import numpy as np
    from pie.plugins import EngineRegistry

    device = EngineRegistry().engine("wgpu").open(0)
    add = device.compile("add")
    a = device.upload(np.ones((4, 8), np.float32))
    result = add(a, a)
    device.synchronize()
    np.testing.assert_array_equal(device.download(result), np.full((4, 8), 2, np.float32))


def test_the_shipped_lavapipe_profile_applies_to_this_device() -> None:
    from pie.plugins import EngineRegistry
    from pie.profiles import active_profile

    device = EngineRegistry().engine("wgpu").open(0)
    if "llvmpipe" not in device.info.name:
        import pytest

        pytest.skip(f"the shipped profile was measured on lavapipe, this device is {device.info.name}")
    profile, reason = active_profile(device)
    assert profile is not None, reason
    assert profile.engine == "wgpu" and "exact device" in reason


def test_a_lost_device_is_the_contracts_device_lost() -> None:
    """A lost device (here destroyed; on a GPU a fault, a hang or a driver reset) made every later call raise a
    plain validation error: pie serve failed each request with a 500 and its /health stayed "ready"."""
    import numpy as np
    from pie.plugins import DeviceLost
    from pie_engine_wgpu.adapters import native_adapters
    from pie_engine_wgpu.backend import WgpuBackend

    backend = WgpuBackend(native_adapters()[0])  # a device of its own: the engine's stays usable
    tensor = backend.upload(np.ones(8, np.float32))
    backend.device.destroy()
    with pytest.raises(DeviceLost, match="device is lost"):
        backend.download(tensor)
    with pytest.raises(DeviceLost, match="device is lost"):
        backend.upload(np.ones(8, np.float32))
