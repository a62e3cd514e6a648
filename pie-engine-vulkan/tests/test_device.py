"""Device probing, selection, diagnosis and engine description of the Vulkan engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pie.contract import KernelRequest
from pie.enginekit.host import may_have_hardware_gpu
from pie.plugins import EngineRegistry
from pie_engine_vulkan.plugin import PRIORITY, SOFTWARE_ONLY_PRIORITY

STATUS = (
    "from pie.plugins import EngineRegistry; s = EngineRegistry().status('vulkan');"
    "print(s.status, '|', s.devices[0].name if s.devices else s.reason)"
)
DIAGNOSIS = (
    "import json; from pie.plugins import EngineRegistry; r = EngineRegistry(); found = r.diagnoses(['vulkan'])['vulkan'];"
    "print(json.dumps([r.status('vulkan').status, [[d.ok, d.what, d.detail, d.fix] for d in found]]))"
)


def run_python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (the Vulkan instance and device list are per process)."""
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip().splitlines()[-1]


def test_probe_shows_the_lavapipe_device() -> None:
    devices = EngineRegistry().status("vulkan").devices
    lavapipe = [d for d in devices if d.name.startswith("llvmpipe")]
    assert lavapipe, f"lavapipe (mesa-vulkan-drivers) not found among {[d.name for d in devices]}"
    assert lavapipe[0].kind == "cpu" and lavapipe[0].vendor == "Mesa"
    assert lavapipe[0].memory_bytes > 0 and dict(lavapipe[0].extra)["vulkan_api"].startswith("1.")


def test_engine_info_imports_no_vulkan_and_ranks_software_devices_below_cpu() -> None:
    code = (
        "import sys; import pie_engine_vulkan.plugin as p;"
        " print(p.engine.pie_engine_info().priority, 'vulkan' in sys.modules)"
    )
    priority, imported = run_python(code).split()
    assert imported == "False"
    assert int(priority) == (PRIORITY if may_have_hardware_gpu() else SOFTWARE_ONLY_PRIORITY)


def test_device_override_by_name_and_a_clear_error_when_nothing_matches() -> None:
    assert run_python(STATUS, PIE_VULKAN_DEVICE="LLVMPIPE").startswith("ok | llvmpipe")
    status = run_python(STATUS, PIE_VULKAN_DEVICE="no-such-gpu")
    assert status.startswith("broken") and "matches no Vulkan device" in status


def test_diagnose_lists_the_device() -> None:
    found = EngineRegistry().diagnoses(["vulkan"])["vulkan"]
    assert all(d.ok for d in found), found
    assert "llvmpipe" in found[-1].detail


def test_diagnose_without_a_driver_says_what_to_install() -> None:
    nowhere = "/nonexistent/pie_icd.json"
    status, found = json.loads(run_python(DIAGNOSIS, VK_ICD_FILENAMES=nowhere, VK_DRIVER_FILES=nowhere))
    assert status != "ok"
    failing = [item for item in found if not item[0]]
    assert failing, found
    _, what, detail, fix = failing[0]
    assert what == "Vulkan driver" and "VK_ICD_FILENAMES" in detail and "vkCreateInstance" in detail
    if sys.platform.startswith("linux"):
        assert "apt-get install mesa-vulkan-drivers" in fix


def test_kernel_source_is_the_slang_source() -> None:
    device = EngineRegistry().engine("vulkan").open(0)
    source = device.source(KernelRequest("rms_norm_linear"))
    assert source is not None and "rms_norm_linear__rows" in source and '[shader("compute")]' in source


def test_device_override_by_index() -> None:
    first = EngineRegistry().status("vulkan").devices[0].name
    assert run_python(STATUS, PIE_VULKAN_DEVICE="0") == f"ok | {first}"
    assert "PIE_VULKAN_DEVICE=99: only" in run_python(STATUS, PIE_VULKAN_DEVICE="99")


def test_the_shipped_lavapipe_profile_applies_to_this_device() -> None:
    from pie.plugins import EngineRegistry
    from pie.profiles import active_profile

    device = EngineRegistry().engine("vulkan").open(0)
    if "llvmpipe" not in device.info.name:
        import pytest

        pytest.skip(f"the shipped profile was measured on lavapipe, this device is {device.info.name}")
    profile, reason = active_profile(device)
    assert profile is not None, reason
    assert profile.engine == "vulkan" and "exact device" in reason


def test_the_device_reads_and_writes_past_a_buffer_robustly() -> None:
    """With robust buffer access (lavapipe has it) a damaged page table's page past the pool reads values of
    the pool or zeros, and a slot past it is dropped: the device goes on, and the pool is left as it was."""
    import numpy as np
    from pie.contract import PageLayout
    from pie_engine_vulkan.plugin import engine as vulkan_engine

    device = EngineRegistry(env={"PIE_ENGINES": "vulkan"}).engine("vulkan").open(0)
    assert vulkan_engine.backend(device.info).robust_buffer_access
    layout = PageLayout(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16, dtype="float32")
    pool = device.allocate_pages(layout)
    k = device.upload(np.ones((3, 32), np.float32))

    def ints(*values: int) -> object:
        return device.upload(np.array(values, np.int32))

    device.compile("append_kv", layer=0)(pool, k, k, ints(0, 1, 10**6))
    for variant in device.kernels()["attention"]:
        attention = device.compile("attention", variant, layer=0, num_heads=2, scale=0.25)
        assert np.isfinite(device.download(attention(k, pool, ints(0, 3), ints(0, 10**6), ints(0, 2), ints(3)))).all()
    stored = device.read_pages(pool, np.arange(8, dtype=np.int32))
    assert stored[:, :1].any() and not stored[:, 1:].any(), "slots 0 and 1 (page 0) were written, nothing else"


def test_a_lost_device_is_the_contracts_device_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """VK_ERROR_DEVICE_LOST (a GPU's fault, hang or driver reset; lavapipe has none, so the submission answers it
    here) raised a bare VkErrorDeviceLost: pie serve failed each request with a 500 and its /health stayed "ready"."""
    import numpy as np
    import vulkan as vk
    from pie.plugins import DeviceLost
    from pie_engine_vulkan.backend import VulkanBackend
    from pie_engine_vulkan.devices import physical_devices

    backend = VulkanBackend(physical_devices()[0])  # a logical device of its own: the engine's is left alone
    tensor = backend.upload(np.ones(8, np.float32))

    def lost(*args: object) -> None:
        raise vk.VkErrorDeviceLost()

    monkeypatch.setattr(vk, "vkQueueSubmit", lost)
    with pytest.raises(DeviceLost, match="VK_ERROR_DEVICE_LOST"):
        backend.download(tensor)
