"""The PJRT devices the engine runs on, as one JAX mesh, and what is shared across launches.

``PIE_XLA_DEVICES=N`` uses the first N devices of JAX's default platform; without it
every device of that platform forms the mesh. After ``jax.distributed.initialize``
(:func:`pie_engine_xla.distributed.initialize`) those are the devices of every process. On the CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set before jax is imported)
makes N host devices to test sharding with.
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from pie.contract import DeviceInfo, DeviceKind, KernelRequest, RegionRequest
from pie.plugins import EngineSettingError

if TYPE_CHECKING:
    from pie_engine_xla.program import KernelLauncher, Program, RegionLauncher

DEVICES_ENV = "PIE_XLA_DEVICES"
AXIS = "model"
"""The mesh's one axis, which tensor parallelism shards over (:mod:`pie.poem.sharding`)."""

_KINDS: dict[str, DeviceKind] = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_VENDORS = {"tpu": "Google", "gpu": "NVIDIA", "cuda": "NVIDIA", "rocm": "AMD"}
"""By PJRT platform; a "gpu" platform whose version names ROCm is AMD's."""


def mesh_devices() -> list[Any]:
    """The devices of the mesh, honouring ``PIE_XLA_DEVICES`` (EngineSettingError where it is no count of them)."""
    import jax

    devices = jax.devices()
    wanted = os.environ.get(DEVICES_ENV, "").strip()
    if not wanted:
        return devices
    try:
        count = int(wanted)
    except ValueError:
        raise EngineSettingError(f"{DEVICES_ENV}={wanted!r} is not a number of devices") from None
    if not 1 <= count <= len(devices):
        raise EngineSettingError(
            f"{DEVICES_ENV}={count} but JAX's {devices[0].platform} platform has {len(devices)} device(s)"
            + (" (on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting)"
               if devices[0].platform == "cpu" else "")
        )
    return devices[:count]


def describe(devices: list[Any]) -> DeviceInfo:
    """The mesh as one pie device: PJRT platform, device kind, total memory."""
    import jax
    import jaxlib
    from pie.enginekit.host import host_memory_bytes

    first = devices[0]
    platform = first.platform
    processes = len({device.process_index for device in devices})
    memory = 0
    for device in devices:
        try:
            stats = device.memory_stats() or {}
        except Exception:
            stats = {}
        memory += int(stats.get("bytes_limit", 0))
    if not memory and platform == "cpu":
        memory = host_memory_bytes() * processes
    count = len(devices)
    kind_name = first.device_kind
    version = getattr(first.client, "platform_version", "")
    return DeviceInfo(
        engine="xla",
        index=0,
        name=kind_name if count == 1 else f"{count} x {kind_name}",
        vendor="AMD" if _KINDS.get(platform) == "gpu" and "rocm" in version.lower() else _VENDORS.get(platform, "host"),
        architecture=kind_name,
        kind=_KINDS.get(platform, "other"),
        memory_bytes=memory,
        driver=f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, PJRT {platform} {version}".strip(),
        extra=(
            ("platform", platform),
            ("device_kind", kind_name),
            ("mesh_devices", str(count)),
            ("device_ids", ",".join(str(d.id) for d in devices)),
            ("processes", str(processes)),
        ),
    )


class MeshDevice:
    """One mesh: shardings and the compiled programs (shared by equal regions)."""

    def __init__(self, devices: list[Any]):
        from jax.sharding import Mesh

        self.devices = devices
        self.size = len(devices)
        self.mesh = Mesh(np.asarray(devices), (AXIS,))
        self.programs: dict[Any, Program] = {}
        self.last: Any = None
        """Outputs of the latest launch or page write (a pool written in place among them), for
        pie_synchronize: the device runs its programs in order, so waiting for these waits for all."""
        self._shardings: dict[tuple[str | None, ...], Any] = {}
        self._regions: dict[RegionRequest, RegionLauncher] = {}
        self._kernels: dict[KernelRequest, KernelLauncher] = {}
        self._lock = threading.Lock()

    def sharding(self, spec: tuple[str | None, ...]) -> Any:
        found = self._shardings.get(spec)
        if found is None:
            from jax.sharding import NamedSharding, PartitionSpec

            found = self._shardings[spec] = NamedSharding(self.mesh, PartitionSpec(*spec))
        return found

    def scalars(self, values: tuple[int, ...]) -> tuple[Any, ...]:
        import jax

        replicated = self.sharding(())
        return tuple(jax.device_put(np.int32(v), replicated) for v in values)

    def launcher(self, region: RegionRequest) -> RegionLauncher:
        """The launcher of a region, sharing the program of every region with the same primitives."""
        from pie.poem.primitives import primitive_region

        from pie_engine_xla.kernels import PRIMITIVES
        from pie_engine_xla.program import Program, RegionLauncher

        with self._lock:
            found = self._regions.get(region)
            if found is not None:
                return found
            expanded, layers = primitive_region(region, PRIMITIVES, "XLA")
            program = self.programs.get(expanded)
            if program is None:
                label = region.label.split(".", 1)[-1] if region.label[:1] == "L" else region.label
                program = Program(self, label, expanded)
                self.programs[expanded] = program
            launcher = self._regions[region] = RegionLauncher(program, region.label, layers)
            return launcher

    def kernel(self, request: KernelRequest) -> KernelLauncher:
        """A catalogue kernel as one-op regions (sharing programs like any region)."""
        from pie_engine_xla.program import KernelLauncher

        with self._lock:
            found = self._kernels.get(request)
            if found is None:
                found = self._kernels[request] = KernelLauncher(self, request.name, request.options)
            return found

    def source(self, request: RegionRequest | KernelRequest) -> str | None:
        """StableHLO of a region or kernel at its latest compiled bucket; None before its first launch."""
        if isinstance(request, RegionRequest):
            launcher = self._regions.get(request)
            return None if launcher is None else launcher.program.stablehlo()
        kernel = self._kernels.get(request)
        texts = [] if kernel is None else [launcher.program.stablehlo() for launcher in kernel.launchers()]
        return next((text for text in texts if text is not None), None)


@lru_cache(maxsize=1)
def mesh_device() -> MeshDevice:
    """The engine's one mesh, made on first use."""
    return MeshDevice(mesh_devices())
