"""Shared fixtures. The ``msl_emulator`` package beside this file runs the MSL kernels on the CPU."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from msl_emulator.driver import EmulatedDriver
from msl_emulator.engine import FakeMTLDevice, emulated_engine
from pie.plugins import Device, EngineRegistry

from pie_engine_metal.context import OpenedDevice
from pie_engine_metal.engine import MetalEngine

ON_MACOS = sys.platform == "darwin"
NOT_MACOS_REASON = "needs Metal: macOS on Apple silicon or an AMD/Intel Mac"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@dataclass
class Emulated:
    device: Device
    driver: EmulatedDriver
    engine: MetalEngine

    @property
    def context(self) -> OpenedDevice:
        return self.engine.backend(self.device.info)


@pytest.fixture
def open_emulated() -> Callable[..., Emulated]:
    """Open the emulated Metal device through the plugin facade."""

    def open_device(simd_width: int = 32, device: FakeMTLDevice | None = None, **kwargs: Any) -> Emulated:
        engine, drivers = emulated_engine(simd_width, device, **kwargs)
        registry = EngineRegistry(autoload=False)
        registry.register("metal", engine)
        opened = registry.engine("metal").open(0)
        opened.upload(np.zeros(1, np.float32))  # opens the context, so the driver exists
        return Emulated(opened, drivers[0], engine)

    return open_device
