"""Hook implementations of the CUDA engine (entry point ``pie.engines: cuda``, the object :data:`engine`).

Page hooks, transfers, weight uploads and pass plans are the kit's
(:class:`pie.enginekit.engine.PassPlanEngine`) over one :class:`~pie_engine_cuda.runtime.GpuDevice`
per device; this module adds the CUDA kernels, description and probing. Nothing here imports
cuda-python or hip-python at import time; the backend is chosen and loaded when devices are probed.
Weights stored as F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K or Q6_K are uploaded and read as
stored (``pie_weight_types``).
``PIE_CUDA_WEIGHT_DTYPE=bfloat16`` (or ``float16``) keeps float32 projection weights
in 16 bits on the device: each is converted once, the first time a projection reads it.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pie.contract import (
    CONTRACT_VERSION,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    RegionRequest,
)
from pie.enginekit.engine import PassPlanEngine
from pie.hookspecs import hookimpl
from pie.plugins import EngineSettingError

from pie_engine_cuda.launch import MAX_HEAD_DIM
from pie_engine_cuda.tensor import STORED_DTYPES

ENGINE = "cuda"
WEIGHT_DTYPE_ENV = "PIE_CUDA_WEIGHT_DTYPE"


def weight_dtype() -> str:
    """``PIE_CUDA_WEIGHT_DTYPE`` (float32 where unset); EngineSettingError for a type the engine does not keep."""
    from pie_engine_cuda.runtime import WEIGHT_DTYPES

    value = os.environ.get(WEIGHT_DTYPE_ENV, "float32").strip() or "float32"
    if value not in WEIGHT_DTYPES:
        raise EngineSettingError(f"{WEIGHT_DTYPE_ENV} is {value!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
    return value


class CudaEngine(PassPlanEngine):
    name = ENGINE
    kv_dtypes = ("float32",)
    stored_types = tuple(STORED_DTYPES)
    max_head_dim = MAX_HEAD_DIM

    def __init__(self) -> None:
        super().__init__()
        self._facts: dict[Hashable, Any] = {}

    def backend_key(self, device: DeviceInfo) -> Hashable:
        extra = dict(device.extra)
        return (extra["backend"], device.index, extra["compile_target"])

    def open_backend(self, device: DeviceInfo) -> Any:
        from pie.enginekit.compile_cache import CompileCache

        from pie_engine_cuda.backend import backend
        from pie_engine_cuda.runtime import GpuDevice

        key = self.backend_key(device)
        facts = self._facts.get(key)
        if facts is None:
            raise RuntimeError(f"device {device.key} was not probed by this process")
        chosen = backend(key[0])
        return GpuDevice(chosen.open(facts), chosen.compiler(), CompileCache(ENGINE), weight_dtype())

    def _upload_stored(self, backend: Any, weight: Any) -> Any:
        return backend.upload_stored(weight)

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        return EngineInfo(
            name=ENGINE,
            contract_version=CONTRACT_VERSION,
            priority=100,
            kernel_languages=("cuda", "hip"),
            description="CUDA C kernels compiled at run time by NVRTC for the local NVIDIA GPU (hiprtc for AMD GPUs)",
        )

    @hookimpl
    def pie_probe_devices(self) -> Sequence[DeviceInfo]:
        from pie_engine_cuda.backend import probe

        weight_dtype()  # the user's setting, read before any device: theirs to correct, wherever the engine runs
        backend, found = probe()
        devices = []
        for facts in found:
            extra = (
                ("backend", backend),
                ("compile_target", facts.compile_target),
                ("warp_size", str(facts.warp_size)),
                ("multiprocessors", str(facts.multiprocessors)),
                ("tensor_cores", "yes" if facts.tensor_cores else "no"),
                *facts.details,
            )
            info = DeviceInfo(
                engine=ENGINE,
                index=facts.ordinal,
                name=facts.name,
                vendor=facts.vendor,
                architecture=facts.architecture,
                kind="integrated-gpu" if facts.integrated else "other" if backend == "emulator" else "gpu",
                memory_bytes=facts.memory_bytes,
                driver=facts.driver,
                extra=extra,
            )
            self._facts[self.backend_key(info)] = facts
            devices.append(info)
        return devices

    @hookimpl
    def pie_diagnose(self) -> Sequence[Diagnosis]:
        from pie_engine_cuda.diagnose import diagnose

        return diagnose()

    @hookimpl
    def pie_list_kernels(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        from pie_engine_cuda.launchers import kernel_listing

        return kernel_listing(dict(device.extra).get("tensor_cores") == "yes")

    @hookimpl
    def pie_compile_kernel(self, device: DeviceInfo, request: KernelRequest) -> Launcher | None:
        from pie_engine_cuda.launchers import KERNELS

        runtime: Any = self.backend(device)
        _, factory = KERNELS[request.name]  # the facade (pie.plugins) already checked the name and variant
        if request.variant is None:
            request = replace(request, variant=self.pie_list_kernels(device)[request.name][0])
        return factory(runtime, request)

    @hookimpl
    def pie_compile_region(self, device: DeviceInfo, region: RegionRequest) -> Launcher | None:
        from pie_engine_cuda.regions import compile_region

        return compile_region(self.backend(device), region)

    @hookimpl
    def pie_kernel_source(self, device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
        if not isinstance(request, KernelRequest):
            return None
        backend = dict(device.extra)["backend"]
        if request.name == "epilogue":
            from pie.eta import compile as compile_eta

            return compile_eta(str(request.option("source"))).render("hip" if backend == "hip" else "cuda").source
        from pie_engine_cuda.launchers import UNIT_OF_KERNEL
        from pie_engine_cuda.sources import unit_source

        unit = UNIT_OF_KERNEL.get(request.name)
        return None if unit is None else unit_source(unit, backend)

    @hookimpl
    def pie_memory_bandwidth(self, device: DeviceInfo, passes: int) -> float | None:
        """The GPU's read bandwidth; None on the host emulator, whose memory is the host's."""
        if dict(device.extra)["backend"] == "emulator":
            return None
        runtime: Any = self.backend(device)
        return float(runtime.read_bandwidth(passes=passes))


engine = CudaEngine()
"""The plugin the entry point ``pie.engines: cuda`` names."""
