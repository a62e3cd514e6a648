"""Discovery, device description, diagnosis and packaging of the Metal engine."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import tomllib
from conftest import ON_MACOS
from msl_emulator.engine import APPLE9, MAC2, FakeMTLDevice
from pie.contract import CONTRACT_VERSION
from pie.hookspecs import REQUIRED_HOOKS
from pie.plugins import EngineRegistry

from pie_engine_metal import plugin, probe

LINUX_MESSAGE = "Metal needs macOS on Apple silicon or an AMD/Intel Mac; this is Linux"
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="checks what the engine says on Linux")


def test_an_apple_silicon_gpu_is_described_from_its_families() -> None:
    info = probe.describe(0, FakeMTLDevice(), os_version="15.1")
    assert (info.engine, info.name, info.vendor, info.architecture, info.kind) == (
        "metal",
        "Apple M3 Max",
        "Apple",
        "apple9",
        "integrated-gpu",
    )
    assert info.memory_bytes == 48 * 2**30 and info.driver == "Metal, macOS 15.1"
    extra = dict(info.extra)
    assert extra["families"].startswith("apple9,apple8,apple7") and extra["unified_memory"] == "yes"
    assert extra["max_buffer_bytes"] == str(32 * 2**30) and extra["registry_id"] == "0x1000005a1"
    assert probe.has_simdgroup_matrices(info) and probe.runs_kernels(probe.families(FakeMTLDevice()))


@pytest.mark.parametrize(
    ("device", "vendor", "architecture", "kind", "runs", "matrices"),
    [
        (FakeMTLDevice("AMD Radeon Pro 5500M", MAC2, unified=False), "AMD", "mac2", "gpu", True, False),
        (FakeMTLDevice("Intel(R) UHD Graphics 630", MAC2), "Intel", "mac2", "integrated-gpu", True, False),
        (
            FakeMTLDevice("Apple A13 GPU", frozenset(range(1001, 1007))),
            "Apple",
            "apple6",
            "integrated-gpu",
            False,
            False,
        ),
        (FakeMTLDevice("Apple M5", APPLE9 | {1010, 5002}), "Apple", "apple10", "integrated-gpu", True, True),
    ],
)
def test_other_gpus(
    device: FakeMTLDevice, vendor: str, architecture: str, kind: str, runs: bool, matrices: bool
) -> None:
    info = probe.describe(2, device)
    assert (info.vendor, info.architecture, info.kind, info.index) == (vendor, architecture, kind, 2)
    assert probe.runs_kernels(probe.families(device)) is runs
    assert probe.has_simdgroup_matrices(info) is matrices


@linux_only
def test_on_linux_the_probe_says_why_and_the_engine_is_listed_broken() -> None:
    with pytest.raises(probe.MetalUnavailable, match=LINUX_MESSAGE):
        probe.system_devices()
    registry = EngineRegistry()
    status = registry.status("metal")
    assert status.status == "broken"
    assert status.reason == f"device probe failed: MetalUnavailable: {LINUX_MESSAGE}"
    assert status.info is not None and status.info.priority == 100 and status.info.kernel_languages == ("msl",)
    assert status.info.contract_version == CONTRACT_VERSION


@linux_only
def test_on_linux_diagnose_points_to_the_engines_that_run_here() -> None:
    findings = EngineRegistry().diagnoses(["metal"])["metal"]
    by_what = {f.what: f for f in findings}
    assert not by_what["macOS"].ok and by_what["macOS"].detail == LINUX_MESSAGE
    assert "pip install pie-engine-vulkan" in by_what["macOS"].fix and "pie-engine-cpu" in by_what["macOS"].fix
    assert set(by_what) == {"macOS"}
    assert probe.not_macos_message("Windows").endswith("this is Windows")


def _fake_macos(monkeypatch: pytest.MonkeyPatch, devices: list[FakeMTLDevice], default: int | None = 0) -> None:
    metal = types.ModuleType("Metal")
    metal.MTLCreateSystemDefaultDevice = lambda: None if default is None else devices[default]  # type: ignore[attr-defined]
    metal.MTLCopyAllDevices = lambda: list(devices)  # type: ignore[attr-defined]
    objc = types.ModuleType("objc")
    objc.__version__ = "12.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "Metal", metal)
    monkeypatch.setitem(sys.modules, "objc", objc)
    monkeypatch.setattr(sys, "platform", "darwin")


def test_on_a_mac_the_default_device_comes_first_and_unsupported_gpus_are_left_out(monkeypatch) -> None:
    amd = FakeMTLDevice("AMD Radeon Pro 5500M", MAC2, unified=False, registry=2)
    intel = FakeMTLDevice("Intel(R) UHD Graphics 630", MAC2, registry=3)
    old = FakeMTLDevice("Apple A12 GPU", frozenset(range(1001, 1006)), registry=4)
    _fake_macos(monkeypatch, [intel, amd, old], default=1)
    assert [d.device_name for d in probe.system_devices()] == [amd.device_name, intel.device_name, old.device_name]
    handles = plugin._discover()
    assert [h.info.name for h in handles] == [amd.device_name, intel.device_name]
    assert [h.info.index for h in handles] == [0, 1]

    findings = probe.diagnose()
    devices = [f for f in findings if f.what == "Metal device"]
    assert [f.ok for f in devices] == [True, True, False]
    assert "need an Apple7+ or Mac2 GPU" in devices[2].detail and devices[2].fix
    assert findings[0].ok and findings[0].detail == "PyObjC 12.0"


def test_on_a_mac_without_pyobjc_diagnose_gives_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "Metal", None)
    monkeypatch.setattr(sys, "platform", "darwin")
    (finding,) = probe.diagnose()
    assert not finding.ok and finding.fix == "pip install pyobjc-framework-Metal"
    with pytest.raises(probe.MetalUnavailable, match="pip install pyobjc-framework-Metal"):
        probe.system_devices()


def test_the_plugin_module_implements_every_required_hook() -> None:
    for hook in REQUIRED_HOOKS:
        assert callable(getattr(plugin, hook)), hook
    assert plugin.pie_engine_info().name == "metal"


def test_listing_engines_imports_no_backend_library() -> None:
    code = (
        "import sys\n"
        "from pie.plugins import EngineRegistry\n"
        "statuses = EngineRegistry().statuses()\n"
        "assert any(s.name == 'metal' for s in statuses)\n"
        "heavy = [m for m in ('Metal', 'objc') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_packaging_keeps_macos_wheels_off_other_systems() -> None:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert "pyobjc-framework-Metal>=10; sys_platform == 'darwin'" in project["dependencies"]
    assert "optional-dependencies" not in project  # the Neural Engine offload is parked in experimental/
    assert project["entry-points"]["pie.engines"] == {"metal": "pie_engine_metal.plugin"}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_MACOS, reason="needs macOS with a Metal GPU")
def test_a_real_mac_lists_its_gpu() -> None:
    status = EngineRegistry().status("metal")
    assert status.status == "ok", status.reason
    assert status.devices[0].architecture.startswith(("apple", "mac2"))


def test_the_entry_point_module_exports_every_hook_the_engine_implements() -> None:
    """The module, not the engine object, is what pluggy registers: a hook left out of it never runs."""
    from pie_engine_metal.engine import MetalEngine

    implemented = {name for name in dir(MetalEngine) if name.startswith("pie_")}
    assert implemented, "MetalEngine implements no hooks"
    assert implemented <= set(vars(plugin)), f"plugin.py does not export {sorted(implemented - set(vars(plugin)))}"
