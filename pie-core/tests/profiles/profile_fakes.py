"""Helpers for the profile tests: a fake engine whose kernel variants cost what a test says, on a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
from pie.contract import CONTRACT_VERSION, DeviceInfo, EngineInfo
from pie.hookspecs import hookimpl
from pie.plugins import Device, EngineRegistry
from pie.profiles.schema import Bucket, DeviceMeta, KernelTuning, Profile, Timing, TuneMeta
from pie.profiles.writer import dump_profile

FAKE_DEVICE = DeviceInfo("fake", 0, "Fake Accelerator 9000", "Acme", "acme3", "gpu", 1 << 30, "acme driver 7")
VERSION = "2.5.0"

Cost = Callable[[str, int, int], float]
"""(variant, rows, static operand elements) -> microseconds."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def advance_us(self, microseconds: float) -> None:
        self.now += int(microseconds * 1000)


def crossover_cost(variant: str, rows: int, size: int) -> float:
    """ "rows" wins below 8 rows, "blas" from 8 up (for every size)."""
    return 10.0 + 5.0 * rows if variant == "rows" else 45.0 + 1.0 * rows


class FakeEngine:
    """A plugin object: ``linear`` (blas, rows) and ``add``; launches advance ``clock`` by ``cost``."""

    def __init__(
        self,
        clock: FakeClock | None = None,
        cost: Cost = crossover_cost,
        info: DeviceInfo = FAKE_DEVICE,
        profiles: tuple[str, ...] = (),
        kernels: dict[str, tuple[str, ...]] | None = None,
    ):
        self.clock = clock or FakeClock()
        self.cost = cost
        self.info = info
        self.shipped = profiles
        self.kernels = kernels or {"linear": ("blas", "rows"), "add": ("numpy",)}
        self.launches: list[tuple[str, str, int]] = []
        self.jitter = np.random.default_rng(0)
        self.jitter_scale = 0.01

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        return EngineInfo(self.info.engine, CONTRACT_VERSION, 5, ("numpy",))

    @hookimpl
    def pie_probe_devices(self) -> list[DeviceInfo]:
        return [self.info]

    @hookimpl
    def pie_list_kernels(self, device: DeviceInfo) -> dict[str, tuple[str, ...]]:
        return self.kernels

    @hookimpl
    def pie_compile_kernel(self, device: DeviceInfo, request):
        variant = request.variant or self.kernels[request.name][0]
        if request.name == "add":
            return lambda a, b: a + b

        def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
            rows = x.shape[0]
            self.launches.append((request.name, variant, rows))
            self.clock.advance_us(
                self.cost(variant, rows, weight.size) * (1 + self.jitter_scale * self.jitter.random())
            )
            y = x @ weight.T
            return y if bias is None else y + bias

        return linear

    @hookimpl
    def pie_allocate_pages(self, device: DeviceInfo, layout):
        return np.zeros(layout.shape, np.float32)

    @hookimpl
    def pie_upload(self, device: DeviceInfo, array: np.ndarray) -> np.ndarray:
        return np.array(array)

    @hookimpl
    def pie_download(self, device: DeviceInfo, tensor: np.ndarray) -> np.ndarray:
        return np.array(tensor)

    @hookimpl
    def pie_device_profiles(self) -> list[str]:
        return list(self.shipped)


def open_fake(engine: FakeEngine, version: str = VERSION) -> Device:
    registry = EngineRegistry(autoload=False, env={})
    registry.register(engine.info.engine, engine, distribution="pie-engine-fake", version=version)
    return registry.engine(engine.info.engine).open(0)


def make_profile(
    name: str = "fake-acme",
    device: DeviceMeta | None = None,
    engine: str = "fake",
    engine_version: str = VERSION,
    choice: str = "rows",
) -> Profile:
    """A valid profile for the fake engine: ``choice`` at rows 1-4 of the 2^12 size bucket, blas at 8."""
    meta = device or DeviceMeta(
        FAKE_DEVICE.vendor, FAKE_DEVICE.name, FAKE_DEVICE.architecture, "gpu", "acme driver 7", 1 << 30
    )
    fast, slow = Timing(15.0, 16.0, 17.5), Timing(48.0, 50.0, 52.0)
    buckets = []
    for rows in (1, 2, 4):
        times = (("blas", slow), ("rows", fast)) if choice == "rows" else (("blas", fast), ("rows", slow))
        buckets.append(Bucket(4096, rows, choice, times, ((64, 64),)))
    buckets.append(
        Bucket(4096, 8, "blas", (("blas", Timing(50.0, 52.0, 55.0)), ("rows", Timing(60.0, 61.0, 63.0))), ((64, 64),))
    )
    return Profile(
        name=name,
        engine=engine,
        engine_version=engine_version,
        device=meta,
        tools=(("python", "3.11.2"), ("pie_core", "0.1.0"), ("fake", VERSION)),
        tune=TuneMeta("quick", "2025-06-01T12:00:00+00:00", 42.5, 2, 9, 0.03, "hidden 64"),
        kernels=(KernelTuning("linear", "blas", ("blas", "rows"), tuple(buckets)),),
    )


VALID_TEXT = dump_profile(make_profile())


def other_device(**changes: str) -> DeviceMeta:
    base = DeviceMeta(FAKE_DEVICE.vendor, FAKE_DEVICE.name, FAKE_DEVICE.architecture, "gpu", "", 1 << 30)
    return replace(base, **changes)
