"""Hook implementations of the XLA engine (entry point ``pie.engines: xla``).

Nothing here imports jax at module import time: listing engines stays cheap.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from functools import wraps
from typing import TYPE_CHECKING, Any

import numpy as np
from pie.contract import (
    CONTRACT_VERSION,
    KV_DTYPES,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    PageLayout,
    RegionRequest,
)
from pie.enginekit.catalogue import checked_launcher
from pie.enginekit.tensor import device_memory_exhausted
from pie.hookspecs import hookimpl
from pie.kernels import attention_options
from pie.plugins import EngineSettingError

from pie_engine_xla import distributed, pages
from pie_engine_xla.mesh import AXIS, DEVICES_ENV, describe, mesh_device, mesh_devices
from pie_engine_xla.tensors import STORED_TYPES, PoolBuffer, Tensor, host_array, to_host

if TYPE_CHECKING:
    from pie.runtime.replicated import ProcessGroup

VARIANT = "xla"
EPILOGUE = "epilogue"
"""The catalogue kernel of eta epilogues, run through eta's JAX rendering (``epilogues.py``)."""
TOP_K = "top_k"
"""Launched on its own, not in regions: it has two outputs (see ``kernels.top_k_launcher``)."""

RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
"""How the message of JAX's error begins where the device has no memory left for what it was asked."""
ACCELERATOR_PRIORITY = 100
CPU_PLATFORM_PRIORITY = -10
"""Below the CPU engine (0): on a CPU, numpy's kernels start instantly and XLA has to compile first."""

ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")
"""Modules whose presence means JAX's default platform is a TPU or GPU, found without importing jax."""


def _accelerator_installed() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0] not in ("", "cpu")
    return any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)


def _on_device(device: DeviceInfo, operation: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``operation`` on the device: guarded for a process group (:func:`distributed.guarded`), and its device running
    out of memory (JAX's RESOURCE_EXHAUSTED) raised as the MemoryError every engine raises for it, not a bare
    JaxRuntimeError (which `pie run` called an internal error)."""

    @wraps(operation)
    def run(*args: Any) -> Any:
        try:
            return operation(*args)
        except Exception as error:
            said = str(error)
            if not said.startswith(RESOURCE_EXHAUSTED):
                raise
            raise device_memory_exhausted(f"{device.key} ({device.name})", None, f"{said} (in {what})") from error

    return distributed.guarded(run, what)


@hookimpl
def pie_engine_info() -> EngineInfo:
    accelerated = _accelerator_installed()
    return EngineInfo(
        name="xla",
        contract_version=CONTRACT_VERSION,
        priority=ACCELERATOR_PRIORITY if accelerated else CPU_PLATFORM_PRIORITY,
        kernel_languages=("stablehlo",),
        description="Poem regions lowered to StableHLO through JAX and run by PJRT (TPU, GPU, CPU); "
        "tensor-parallel over a device mesh",
    )


@hookimpl
def pie_probe_devices() -> Sequence[DeviceInfo]:
    return [describe(mesh_device().devices)]


@hookimpl
def pie_diagnose() -> Sequence[Diagnosis]:
    found: list[Diagnosis] = []
    try:
        import jax
        import jaxlib
    except ImportError as exc:
        return [Diagnosis(False, "jax", f"cannot import jax: {exc}", 'pip install "jax[cpu]"')]
    found.append(Diagnosis(True, "jax", f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"))
    try:
        devices = mesh_devices()
        kinds = sorted({d.device_kind for d in devices})
        detail = f"{devices[0].platform}: {len(devices)} device(s) ({', '.join(kinds)})"
        found.append(Diagnosis(True, "PJRT platform", detail))
        if devices[0].platform == "cpu":
            plugins = 'TPU: pip install "jax[tpu]"; NVIDIA GPU: pip install "jax[cuda12]"'
            found.append(Diagnosis(True, "accelerator plugin", f"none, JAX runs on the CPU ({plugins})"))
    except EngineSettingError as exc:
        found.append(Diagnosis(False, DEVICES_ENV, str(exc), f"set {DEVICES_ENV} to a count of JAX's devices, or unset it"))
    except Exception as exc:
        found.append(
            Diagnosis(False, "PJRT platform", f"{type(exc).__name__}: {exc}",
                      'pip install -U "jax[cpu]"  # or "jax[tpu]", "jax[cuda12]" for accelerators')
        )
    return found


@hookimpl
def pie_list_kernels(device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
    from pie_engine_xla.kernels import KERNELS

    return {name: (VARIANT,) for name in (*KERNELS, EPILOGUE, TOP_K)}


@hookimpl
def pie_weight_types(device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
    from pie.kernels import WEIGHT_KERNELS

    return dict.fromkeys(WEIGHT_KERNELS, STORED_TYPES)  # each widens its weight inside the region


@hookimpl
def pie_kv_dtypes(device: DeviceInfo) -> Sequence[str] | None:
    return KV_DTYPES


@hookimpl
def pie_compile_kernel(device: DeviceInfo, request: KernelRequest) -> Launcher | None:
    # The facade compiles only what pie_list_kernels lists, in the one variant listed.
    if request.name == EPILOGUE:
        from pie_engine_xla.epilogues import epilogue_launcher

        return epilogue_launcher(request.option("source"), request.option("params", ()))
    # The epilogue's eta program checks its own inputs; every other kernel's arguments are checked before
    # its region (or top_k's function) is traced for them.
    if request.name == TOP_K:
        from pie_engine_xla.kernels import top_k_launcher

        launcher = top_k_launcher(request.option("k"), mesh_device())
    else:
        if request.name == "attention":
            attention_options(request.option("window"), request.option("softcap"))  # a bad option fails here
        launcher = mesh_device().kernel(request)
    return _on_device(device, checked_launcher(request, launcher), f"kernel {request.name}")


@hookimpl
def pie_compile_region(device: DeviceInfo, region: RegionRequest) -> Launcher | None:
    from pie_engine_xla.kernels import KERNELS

    if any(op.kernel not in KERNELS for op in region.ops):
        return None  # e.g. an eta epilogue: Poem lowers this region kernel by kernel instead
    return _on_device(device, mesh_device().launcher(region), f"region {region.label}")


@hookimpl
def pie_kernel_source(device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
    """StableHLO of a region (or kernel) at the shape bucket it last compiled for.

    Weight shapes reach the engine only with the first launch, so this is None before it.
    """
    return mesh_device().source(request)


@hookimpl
def pie_synchronize(device: DeviceInfo) -> None:
    import jax

    last = mesh_device().last
    if last is not None:
        _on_device(device, jax.block_until_ready, "a synchronization")(last)


@hookimpl
def pie_allocate_pages(device: DeviceInfo, layout: PageLayout) -> Any:
    if layout.dtype not in KV_DTYPES:
        raise ValueError(f"the XLA engine keeps KV pages in {', '.join(KV_DTYPES)}, not {layout.dtype}")
    import jax
    import jax.numpy as jnp

    mesh = mesh_device()
    distributed.agree_on_setup(layout, mesh.devices)
    # Shard the KV-head axis when it divides evenly: attention then stays on each device's heads.
    spec = (None, None, None, None, AXIS) if mesh.size > 1 and layout.num_kv_heads % mesh.size == 0 else ()
    sharding = mesh.sharding(spec)
    zeros = jax.jit(lambda: jnp.zeros(layout.shape, layout.dtype), out_shardings=sharding)
    array = _on_device(device, zeros, "a page pool's allocation")()
    return PoolBuffer(array, layout, sharding)


@hookimpl
def pie_free_pages(device: DeviceInfo, pool: PoolBuffer) -> None:
    if pool.array is not None:
        pool.array.delete()
        pool.array = None


@hookimpl
def pie_read_pages(device: DeviceInfo, pool: PoolBuffer, page_ids: np.ndarray) -> np.ndarray | None:
    return _on_device(device, pages.read_pages, "a page read")(pool, np.asarray(page_ids, dtype=np.int32))


@hookimpl
def pie_write_pages(device: DeviceInfo, pool: PoolBuffer, page_ids: np.ndarray, data: np.ndarray) -> None:
    _on_device(device, pages.write_pages, "a page write")(pool, np.asarray(page_ids, dtype=np.int32), data)
    mesh_device().last = pool.array


@hookimpl
def pie_copy_pages(device: DeviceInfo, pool: PoolBuffer, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
    _on_device(device, pages.copy_pages, "a page copy")(
        pool, np.asarray(source_ids, dtype=np.int32), np.asarray(destination_ids, dtype=np.int32))
    mesh_device().last = pool.array


@hookimpl
def pie_upload(device: DeviceInfo, array: np.ndarray) -> Tensor | None:
    # Placed on first use, when the launch knows the layout; the copy keeps upload's snapshot semantics.
    return Tensor(host=np.array(array, copy=True))


@hookimpl
def pie_upload_weights(device: DeviceInfo, arrays: Sequence[Any]) -> list[Tensor] | None:
    from pie.weights import StoredWeight

    distributed.record_weights(arrays)
    return [
        Tensor(host=host_array(a), weight_type=a.type, columns=a.shape[1]) if isinstance(a, StoredWeight)
        else Tensor(host=np.array(a, copy=True))
        for a in arrays
    ]


@hookimpl
def pie_download(device: DeviceInfo, tensor: Tensor) -> np.ndarray | None:
    return _on_device(device, to_host, "a download")(tensor)


@hookimpl
def pie_join_process_group(coordinator: str | None, num_processes: int | None, process_id: int | None) -> ProcessGroup:
    return distributed.initialize(coordinator, num_processes, process_id)


@hookimpl
def pie_leave_process_group() -> None:
    distributed.shutdown()
