"""Hook implementations of the CUDA engine (entry point ``pie.engines: cuda``).

Nothing here imports cuda-python or hip-python at import time; the backend is
chosen and loaded when devices are probed. Weights stored as F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q4_K, Q5_K or Q6_K are uploaded and read as stored (``pie_weight_types``).
``PIE_CUDA_WEIGHT_DTYPE=bfloat16`` (or ``float16``) keeps float32 projection weights
in 16 bits on the device: each is converted once, the first time a projection reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pie.contract import (
    CONTRACT_VERSION,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    PageLayout,
    PassPlan,
    RegionRequest,
)
from pie.hookspecs import hookimpl

ENGINE = "cuda"
WEIGHT_DTYPE_ENV = "PIE_CUDA_WEIGHT_DTYPE"

_facts: dict[tuple[str, int, str], Any] = {}
_runtimes: dict[tuple[str, int, str], Any] = {}


def _backend_of(device: DeviceInfo) -> str:
    return dict(device.extra)["backend"]


def _key(backend: str, index: int, compile_target: str) -> tuple[str, int, str]:
    return (backend, index, compile_target)


def _runtime(device: DeviceInfo) -> Any:
    """The device's runtime, created on first use."""
    extra = dict(device.extra)
    key = _key(extra["backend"], device.index, extra["compile_target"])
    runtime = _runtimes.get(key)
    if runtime is None:
        from pie_engine_cuda.backend import backend
        from pie.enginekit.compile_cache import CompileCache
        from pie_engine_cuda.runtime import GpuDevice

        facts = _facts.get(key)
        if facts is None:
            raise RuntimeError(f"device {device.key} was not probed by this process")
        weight_dtype = os.environ.get(WEIGHT_DTYPE_ENV, "float32").strip() or "float32"
        chosen = backend(key[0])
        runtime = GpuDevice(chosen.open(facts), chosen.compiler(), CompileCache(ENGINE), weight_dtype)
        _runtimes[key] = runtime
    return runtime


@hookimpl
def pie_engine_info() -> EngineInfo:
    return EngineInfo(
        name=ENGINE,
        contract_version=CONTRACT_VERSION,
        priority=100,
        kernel_languages=("cuda", "hip"),
        description="CUDA C kernels compiled at run time by NVRTC for the local NVIDIA GPU (hiprtc for AMD GPUs)",
    )


@hookimpl
def pie_probe_devices() -> Sequence[DeviceInfo]:
    from pie_engine_cuda.backend import probe

    backend, found = probe()
    devices = []
    for facts in found:
        kind = "integrated-gpu" if facts.integrated else "other" if backend == "emulator" else "gpu"
        extra = (
            ("backend", backend),
            ("compile_target", facts.compile_target),
            ("warp_size", str(facts.warp_size)),
            ("multiprocessors", str(facts.multiprocessors)),
            ("tensor_cores", "yes" if facts.tensor_cores else "no"),
            *facts.details,
        )
        devices.append(
            DeviceInfo(
                engine=ENGINE,
                index=facts.ordinal,
                name=facts.name,
                vendor=facts.vendor,
                architecture=facts.architecture,
                kind=kind,
                memory_bytes=facts.memory_bytes,
                driver=facts.driver,
                extra=extra,
            )
        )
        _facts[_key(backend, facts.ordinal, facts.compile_target)] = facts
    return devices


@hookimpl
def pie_diagnose() -> Sequence[Diagnosis]:
    from pie_engine_cuda.diagnose import diagnose

    return diagnose()


@hookimpl
def pie_list_kernels(device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
    from pie_engine_cuda.launchers import kernel_listing

    return kernel_listing(dict(device.extra).get("tensor_cores") == "yes")


STORED_TYPE_KERNELS = ("embedding", "linear", "linear_add", "rms_norm_linear", "rms_norm_gate_up_silu")
"""The kernels that read weights in their stored types (every variant; ``tc`` runs block types tiled)."""


@hookimpl
def pie_weight_types(device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
    from pie_engine_cuda.runtime import STORED_DTYPES

    return dict.fromkeys(STORED_TYPE_KERNELS, tuple(STORED_DTYPES))


@hookimpl
def pie_compile_kernel(device: DeviceInfo, request: KernelRequest) -> Launcher | None:
    from pie_engine_cuda.launchers import KERNELS

    _, factory = KERNELS[request.name]  # the facade (pie.plugins) already checked the name and variant
    return factory(_runtime(device), request)


@hookimpl
def pie_device_profiles() -> Sequence[str]:
    from pie.profiles.shipped import shipped_profiles

    return shipped_profiles("pie_engine_cuda")


@hookimpl
def pie_kernel_source(device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
    if not isinstance(request, KernelRequest):
        return None
    if request.name == "epilogue":
        from pie.eta import compile as compile_eta

        language = "hip" if _backend_of(device) == "hip" else "cuda"
        return compile_eta(str(request.option("source"))).render(language).source
    from pie_engine_cuda.launchers import UNIT_OF_KERNEL
    from pie_engine_cuda.sources import unit_source

    unit = UNIT_OF_KERNEL.get(request.name)
    return None if unit is None else unit_source(unit, _backend_of(device))


@hookimpl
def pie_synchronize(device: DeviceInfo) -> None:
    _runtime(device).synchronize()


@hookimpl
def pie_allocate_pages(device: DeviceInfo, layout: PageLayout) -> Any:
    if layout.dtype != "float32":
        raise ValueError(f"the CUDA engine keeps KV pages in float32, not {layout.dtype}")
    return _runtime(device).zeros(layout.shape)


@hookimpl
def pie_free_pages(device: DeviceInfo, pool: Any) -> None:
    pool.free()


@hookimpl
def pie_read_pages(device: DeviceInfo, pool: Any, page_ids: np.ndarray) -> np.ndarray | None:
    return _runtime(device).copy_pages(pool, page_ids, None)


@hookimpl
def pie_write_pages(device: DeviceInfo, pool: Any, page_ids: np.ndarray, data: np.ndarray) -> None:
    _runtime(device).copy_pages(pool, page_ids, data)


@hookimpl
def pie_copy_pages(device: DeviceInfo, pool: Any, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
    _runtime(device).copy_within(pool, source_ids, destination_ids)


@hookimpl
def pie_begin_pass(device: DeviceInfo, plan: PassPlan) -> None:
    from pie_engine_cuda.attention_plan import PassWork

    runtime = _runtime(device)
    runtime.pass_work = PassWork.of_plan(plan, runtime.upload)


@hookimpl
def pie_end_pass(device: DeviceInfo) -> None:
    _runtime(device).pass_work = None


@hookimpl
def pie_upload(device: DeviceInfo, array: np.ndarray) -> Any:
    return _runtime(device).upload(array)


@hookimpl
def pie_upload_weights(device: DeviceInfo, arrays: Sequence[Any]) -> list[Any] | None:
    runtime = _runtime(device)
    return [runtime.upload_weight(array) for array in arrays]


@hookimpl
def pie_download(device: DeviceInfo, tensor: Any) -> np.ndarray | None:
    return _runtime(device).download(tensor)


@hookimpl
def pie_memory_bandwidth(device: DeviceInfo, passes: int) -> float | None:
    """The GPU's read bandwidth; None on the host emulator, whose memory is the host's."""
    if _backend_of(device) == "emulator":
        return None
    return float(_runtime(device).read_bandwidth(passes=passes))


@hookimpl
def pie_compile_region(device: DeviceInfo, region: RegionRequest) -> Launcher | None:
    from pie_engine_cuda.regions import compile_region

    return compile_region(_runtime(device), region)
