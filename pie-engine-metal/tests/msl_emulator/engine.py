"""The Metal engine wired to the CPU emulator, and a stand-in ``MTLDevice`` for probing."""

from __future__ import annotations

from dataclasses import dataclass, field

from pie.contract import Diagnosis
from pie.plugins import EngineRegistry

from msl_emulator.driver import EmulatedDriver
from pie_engine_metal import probe
from pie_engine_metal.engine import DeviceHandle, MetalEngine

APPLE9 = frozenset({1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 5001})
"""The families an M3/M4 GPU reports."""
MAC2 = frozenset({2002, 5001})
"""An AMD or Intel GPU in a Mac."""


@dataclass
class FakeMTLDevice:
    """Answers the MTLDevice methods `pie_engine_metal.probe.describe` calls."""

    device_name: str = "Apple M3 Max"
    family_codes: frozenset[int] = APPLE9
    unified: bool = True
    working_set: int = 48 * 2**30
    max_buffer: int = 32 * 2**30
    registry: int = 0x1000005A1
    calls: list[str] = field(default_factory=list)

    def name(self) -> str:
        return self.device_name

    def supportsFamily_(self, code: int) -> bool:
        return code in self.family_codes

    def recommendedMaxWorkingSetSize(self) -> int:
        return self.working_set

    def hasUnifiedMemory(self) -> bool:
        return self.unified

    def maxBufferLength(self) -> int:
        return self.max_buffer

    def maxThreadgroupMemoryLength(self) -> int:
        return 32768

    def registryID(self) -> int:
        return self.registry


def emulated_engine(
    simd_width: int = 32,
    device: FakeMTLDevice | None = None,
    *,
    seed: int = 0,
    dispatches_per_commit: int = 64,
) -> tuple[MetalEngine, list[EmulatedDriver]]:
    """A MetalEngine whose one device runs on the CPU emulator; the list receives the opened driver."""
    device = device or FakeMTLDevice()
    opened: list[EmulatedDriver] = []

    def open_driver() -> EmulatedDriver:
        driver = EmulatedDriver(simd_width, seed=seed)
        opened.append(driver)
        return driver

    info = probe.describe(0, device, os_version="emulated")
    engine = MetalEngine(
        lambda: [DeviceHandle(info, open_driver)],
        lambda: [Diagnosis(True, "emulator", f"MSL kernels compiled with g++, {simd_width}-lane simdgroups")],
        dispatches_per_commit=dispatches_per_commit,
    )
    return engine, opened


def emulated_registry(**kwargs: object) -> EngineRegistry:
    registry = EngineRegistry(autoload=False)
    engine, _ = emulated_engine(**kwargs)  # type: ignore[arg-type]
    registry.register("metal", engine, distribution="pie-engine-metal (emulated)")
    return registry
