"""Hook implementations of the CPU engine (entry point ``pie.engines: cpu``)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np
from pie import kernels as reference
from pie.blas import blas_kernel_problems, blas_libraries, describe_blas_library
from pie.contract import (
    CONTRACT_VERSION,
    KV_DTYPES,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    PageLayout,
    PassPlan,
    RegionRequest,
    kv_host_dtype,
)
from pie.enginekit.catalogue import checked_launcher
from pie.enginekit.compile_cache import cache_dir_env
from pie.enginekit.host import cpu_name, cpu_vendor, host_memory_bytes
from pie.enginekit.host_compiler import HostBuildError, find_compiler
from pie.hookspecs import hookimpl

from pie_engine_cpu import kernels, memory, native

_Factory = Callable[[KernelRequest], Launcher]
NATIVE = "native"
"""The variant compiled on this machine by its C compiler (:mod:`pie_engine_cpu.native`); listed only where it builds."""


def _native_module(request: KernelRequest) -> Any | None:
    """:mod:`pie_engine_cpu.native` when the request asks for its variant (or the default) and it builds."""
    return native if request.variant in (NATIVE, None) and native.available() else None


def _module(request: KernelRequest) -> Any:
    """Where a kernel that the native library and numpy both implement under one name comes from."""
    return _native_module(request) or kernels


def _projection(request: KernelRequest, *options: Any) -> Launcher:
    """A projection kernel in its requested variant: native (the default where it builds; BLAS past
    ``NativeKernels.max_rows`` rows), BLAS (``numpy``/``blas``: the default elsewhere),
    or one BLAS GEMV per row (``kernels.ROWS``).

    ``options`` go to the factories (``make_*``) of the kernels that take them.
    """
    member = f"make_{request.name}" if options else request.name
    family = kernels.ROWS if request.variant == "rows" else kernels.BLAS
    kernel = getattr(family, member)(*options) if options else getattr(family, member)
    compiled = _native_module(request)
    return kernel if compiled is None else getattr(compiled, f"make_{request.name}")(kernel, *options)


def _embedding(request: KernelRequest) -> Launcher:
    """Rows of the table: stored tables dequantized natively (float32 tables by numpy in either variant)."""
    return native.make_embedding(kernels.embedding) if _native_module(request) else kernels.embedding


_KERNELS: dict[str, tuple[tuple[str, ...], _Factory]] = {
    "embedding": ((NATIVE, "numpy"), lambda r: _embedding(r)),
    "rms_norm": (("numpy",), lambda r: kernels.make_rms_norm(r.option("eps"))),
    "rms_norm_heads": (("numpy",), lambda r: kernels.make_rms_norm_heads(r.option("eps"), r.option("head_dim"))),
    "linear": ((NATIVE, "blas", "rows"), _projection),
    "add": (("numpy",), lambda r: kernels.add),
    "slice_columns": (("numpy",), lambda r: kernels.make_slice_columns(r.option("start"), r.option("stop"))),
    "silu_mul": (("numpy",), lambda r: kernels.silu_mul),
    "rope": ((NATIVE, "numpy"), lambda r: _module(r).make_rope(r.option("head_dim"))),
    "append_kv": ((NATIVE, "numpy"), lambda r: _module(r).make_append_kv(r.option("layer"))),
    "attention": (
        (NATIVE, "numpy"),
        lambda r: _module(r).make_attention(
            r.option("layer"), r.option("num_heads"), r.option("scale"), r.option("window", 0), r.option("softcap", 0.0)
        ),
    ),
    "gather_rows": (("numpy",), lambda r: reference.gather_rows),  # core's references are these kernels, in float32
    "argmax": (("numpy",), lambda r: reference.argmax),
    "epilogue": (
        ("numpy", "opencl"),
        lambda r: kernels.make_epilogue(r.option("source"), r.option("params", ()), r.variant or "numpy"),
    ),
    "softmax": (("numpy",), lambda r: kernels.make_softmax(r.option("temperature"))),
    "top_k": (("numpy",), lambda r: kernels.make_top_k(r.option("k"))),
    "rms_norm_linear": ((NATIVE, "numpy", "rows"), lambda r: _projection(r, r.option("eps"))),
    "linear_add": ((NATIVE, "numpy", "rows"), _projection),
    "rms_norm_gate_up_silu": ((NATIVE, "numpy", "rows"), lambda r: _projection(r, r.option("eps"))),
}


@hookimpl
def pie_engine_info() -> EngineInfo:
    return EngineInfo(
        name="cpu",
        contract_version=CONTRACT_VERSION,
        priority=0,
        kernel_languages=("c", "numpy"),
        description="C kernels built on this machine, and numpy; host-RAM page pool and offload target",
    )


@cache
def _host() -> DeviceInfo:
    return DeviceInfo(
        engine="cpu",
        index=0,
        name=cpu_name(),
        vendor=cpu_vendor(),
        architecture=platform.machine(),
        kind="cpu",
        memory_bytes=host_memory_bytes(),
        driver=f"numpy {np.__version__}",
        extra=(("cores", str(os.cpu_count() or 1)),),
    )


@hookimpl
def pie_probe_devices() -> Sequence[DeviceInfo]:
    native.activations()  # the user's setting is read here too, where the native kernels do not build
    return [_host()]


@hookimpl
def pie_diagnose() -> Sequence[Diagnosis]:
    libraries = blas_libraries()
    blas = ", ".join(map(describe_blas_library, libraries)) or "numpy reports no BLAS library"
    found = [Diagnosis(True, "numpy", f"numpy {np.__version__}"), Diagnosis(True, "BLAS", blas)]
    found.extend(Diagnosis(False, "BLAS kernels", *problem) for problem in blas_kernel_problems(libraries))
    try:
        library = native.load()
        built = f"built with {find_compiler()}, {library.threads} threads: {library.path}"
        found.append(Diagnosis(True, "native kernels", built))
        if library.cache_problem:
            kept = (f"the native kernels are kept in {library.cache_fallback}, this user's own folder"
                    if library.cache_fallback is not None else "every process builds the native kernels again")
            found.append(Diagnosis(False, "kernel cache", f"cannot be written ({library.cache_problem}): {kept}",
                                   f"make it writable, or name a writable folder in {cache_dir_env(native.ENGINE)}"))
    except HostBuildError as error:
        found.append(Diagnosis(False, "native kernels", f"{error}; decode projections and attention run through numpy",
                               error.fix))
    from pie_engine_cpu import opencl  # here, not at import: it loads the eta compiler

    if _opencl_available() and opencl.available():
        found.append(Diagnosis(True, "OpenCL (optional)", "eta epilogues can run fused through OpenCL"))
    else:
        missing = "no OpenCL driver that builds kernels: eta epilogues run through numpy only"
        fix = "pip install 'pie-engine-cpu[opencl]' && apt-get install pocl-opencl-icd"
        found.append(Diagnosis(False, "OpenCL (optional)", missing, fix))
    return found


@hookimpl
def pie_list_kernels(device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
    listed = {name: variants for name, (variants, _) in _KERNELS.items()}
    if not _opencl_available():
        listed["epilogue"] = ("numpy",)
    if not native.available():
        listed = {name: tuple(v for v in variants if v != NATIVE) for name, variants in listed.items()}
    return listed


@hookimpl
def pie_unavailable_variants(device: DeviceInfo) -> Mapping[str, str] | None:
    reason = native.unavailable_reason()
    return {} if reason is None else {NATIVE: f"native kernels are unavailable: {reason}"}


@hookimpl
def pie_weight_types(device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
    """The kernels that read weights in their stored types (every variant: numpy ones dequantize per call)."""
    return dict.fromkeys(reference.WEIGHT_KERNELS, native.WEIGHT_TYPES) if native.available() else None


@cache
def _opencl_available() -> bool:
    """pyopencl is installed and an OpenCL driver is registered.

    A cheap look only: initialising OpenCL loads PoCL's LLVM, which aborts the process when
    another LLVM (hiprtc's) is already loaded, so listing kernels must never do it.
    """
    import importlib.util
    from pathlib import Path

    vendors = Path("/etc/OpenCL/vendors")
    return importlib.util.find_spec("pyopencl") is not None and vendors.is_dir() and any(vendors.glob("*.icd"))


@hookimpl
def pie_compile_kernel(device: DeviceInfo, request: KernelRequest) -> Launcher | None:
    entry = _KERNELS.get(request.name)
    if entry is None:
        return None
    variants, factory = entry
    if request.variant is not None and request.variant not in variants:
        return None
    if request.variant == NATIVE and not native.available():
        return None
    return checked_launcher(request, factory(request))  # every variant's arguments checked before it reads them


# regions and layers are imported when a plan is built, not when the engine is discovered.
@hookimpl
def pie_compile_region(device: DeviceInfo, region: RegionRequest) -> Launcher | None:
    from pie_engine_cpu.regions import compile_region

    return compile_region(region) if native.available() else None


@hookimpl
def pie_compile_block(device: DeviceInfo, block: RegionRequest) -> Launcher | None:
    from pie_engine_cpu.layers import compile_block

    return compile_block(block) if native.available() else None


@hookimpl
def pie_compile_stack(device: DeviceInfo, stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> Launcher | None:
    from pie_engine_cpu.layers import compile_stack

    return compile_stack(stack, blocks) if native.available() else None


@hookimpl
def pie_kv_dtypes(device: DeviceInfo) -> Sequence[str]:
    return KV_DTYPES


@hookimpl
def pie_allocate_pages(device: DeviceInfo, layout: PageLayout) -> Any:
    return np.zeros(layout.shape, dtype=kv_host_dtype(layout.dtype))


@hookimpl
def pie_read_pages(device: DeviceInfo, pool: np.ndarray, page_ids: np.ndarray) -> np.ndarray:
    return pool[:, page_ids]


@hookimpl
def pie_write_pages(device: DeviceInfo, pool: np.ndarray, page_ids: np.ndarray, data: np.ndarray) -> None:
    pool[:, page_ids] = data


@hookimpl
def pie_copy_pages(device: DeviceInfo, pool: np.ndarray, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
    pool[:, destination_ids] = pool[:, source_ids]


@hookimpl
def pie_begin_pass(device: DeviceInfo, plan: PassPlan) -> None:
    """The launchers read the pass's positions, attention indices and decode-only flag from ``plan``
    (:class:`pie_engine_cpu.kernels.PassFacts`); the numpy attention reads its arguments."""
    kernels.begin_pass(plan)


@hookimpl
def pie_end_pass(device: DeviceInfo) -> None:
    kernels.end_pass()


@hookimpl
def pie_upload(device: DeviceInfo, array: np.ndarray) -> np.ndarray:
    # A copy, as on any device: the caller may reuse its array.
    return np.array(array, order="C", copy=True)


@hookimpl
def pie_memory_bandwidth(device: DeviceInfo, passes: int) -> float | None:
    return native.read_bandwidth(passes=passes) if native.available() else None


@hookimpl
def pie_upload_weights(device: DeviceInfo, arrays: Sequence[Any]) -> list[Any]:
    return memory.pack(arrays)


@hookimpl
def pie_download(device: DeviceInfo, tensor: np.ndarray) -> np.ndarray:
    return np.array(tensor, order="C", copy=True)


@hookimpl
def pie_device_profiles() -> Sequence[str]:
    from pie.profiles.shipped import shipped_profiles

    return shipped_profiles("pie_engine_cpu")
