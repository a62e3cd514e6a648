"""The HIP runtime through hip-python (the ``rocm`` extra), for AMD GPUs.

hip-python's version must match the installed ROCm (its own requirement); the
kernels come from hiprtc (:mod:`pie_engine_cuda.hiprtc_lib`). Launches pass the
argument struct through ``extra`` (HIP_LAUNCH_PARAM_BUFFER_POINTER), which every
ROCm release accepts for module launches.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from pie_engine_cuda.api import (
    SYNC_UPLOAD_BYTES,
    BoundLaunch,
    DeviceFacts,
    GpuError,
    ParamLayout,
    params_size,
)
from pie.enginekit.compile_cache import Artifacts
from pie_engine_cuda.tensor import OutOfDeviceMemory

HIP_LAUNCH_PARAM_BUFFER_POINTER = 0x01
HIP_LAUNCH_PARAM_BUFFER_SIZE = 0x02
HIP_LAUNCH_PARAM_END = 0x03


class HipUnavailable(RuntimeError):
    """hip-python, the HIP runtime or hiprtc is missing; the message says how to fix it."""


def hip_module() -> Any:
    try:
        from hip import hip
    except ImportError as exc:
        raise HipUnavailable(f"hip-python is not installed ({exc}): `pip install 'pie-engine-cuda[rocm]'`") from exc
    return hip


def check(hip: Any, result: tuple, what: str) -> Any:
    err, *values = result
    if err != hip.hipError_t.hipSuccess:
        raise GpuError(f"{what} failed: {err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def init_hip(hip: Any) -> Any:
    try:
        (err,) = hip.hipInit(0)
    except RuntimeError as exc:  # hip-python could not dlopen libamdhip64
        raise HipUnavailable(
            f"the HIP runtime (libamdhip64.so) cannot be loaded ({exc}): install ROCm "
            "(https://rocm.docs.amd.com), or `apt-get install libamdhip64-dev` on Debian/Ubuntu"
        ) from exc
    return err


def probe_hip() -> list[DeviceFacts]:
    """Every AMD GPU HIP sees; [] when the runtime loads but finds none."""
    from pie_engine_cuda.compiler import Hiprtc

    hip = hip_module()
    err = init_hip(hip)
    if err in (hip.hipError_t.hipErrorNoDevice, hip.hipError_t.hipErrorInvalidDevice):
        return []
    if err != hip.hipError_t.hipSuccess:
        raise HipUnavailable(f"hipInit failed: {err} (does `rocminfo` list the GPU?)")
    count = check(hip, hip.hipGetDeviceCount(), "hipGetDeviceCount")
    if not count:
        return []
    try:
        rtc = Hiprtc()
        rtc_version = rtc.version
    except Exception as exc:
        raise HipUnavailable(f"hiprtc cannot be loaded: {exc}") from exc
    driver_version = check(hip, hip.hipDriverGetVersion(), "hipDriverGetVersion")
    attribute = hip.hipDeviceAttribute_t
    devices = []
    for ordinal in range(count):

        def get(attr: Any, ordinal: int = ordinal) -> int:
            return int(check(hip, hip.hipDeviceGetAttribute(attr, ordinal), "hipDeviceGetAttribute"))

        props = check(hip, hip.hipGetDeviceProperties(ordinal), "hipGetDeviceProperties")
        arch_name = _text(props.gcnArchName)
        name = _text(check(hip, hip.hipDeviceGetName(256, ordinal), "hipDeviceGetName"))
        devices.append(
            DeviceFacts(
                ordinal=ordinal,
                name=name,
                vendor="AMD",
                architecture=arch_name.split(":", 1)[0],
                compile_target=arch_name,
                memory_bytes=int(check(hip, hip.hipDeviceTotalMem(ordinal), "hipDeviceTotalMem")),
                driver=f"HIP {driver_version}",
                warp_size=get(attribute.hipDeviceAttributeWarpSize),
                multiprocessors=get(attribute.hipDeviceAttributeMultiprocessorCount),
                integrated=bool(get(attribute.hipDeviceAttributeIntegrated)),
                details=(("gcn_arch", arch_name), ("compiler", f"hiprtc {rtc_version} ({rtc.origin})")),
            )
        )
    return devices


def _text(value: Any) -> str:
    """A C string from hip-python (str, bytes or CStr) up to its terminating NUL."""
    text = value if isinstance(value, str) else bytes(value).decode(errors="replace")
    return text.split("\0", 1)[0]


class HipApi:
    """One AMD GPU: one stream, module loading and bound launches."""

    backend = "hip"

    def __init__(self, facts: DeviceFacts):
        hip = hip_module()
        self._hip = hip
        self._ok = hip.hipError_t.hipSuccess
        self.facts = facts
        err = init_hip(hip)
        if err != self._ok:
            raise GpuError(f"hipInit failed: {err}")
        self._select()
        self._stream = check(hip, hip.hipStreamCreate(), "hipStreamCreate")
        self._in_flight: list[np.ndarray] = []

    def _select(self) -> None:
        check(self._hip, self._hip.hipSetDevice(self.facts.ordinal), "hipSetDevice")

    def mem_alloc(self, nbytes: int) -> int:
        err, ptr = self._hip.hipMalloc(nbytes)
        if err == self._hip.hipError_t.hipErrorOutOfMemory:
            raise OutOfDeviceMemory(f"hipMalloc({nbytes}) failed: out of memory")
        check(self._hip, (err,), "hipMalloc")
        return int(ptr)

    def mem_free(self, ptr: int) -> None:
        check(self._hip, self._hip.hipFree(ptr), "hipFree")

    def memset_zero(self, ptr: int, nbytes: int) -> None:
        check(self._hip, self._hip.hipMemsetD8Async(ptr, 0, nbytes, self._stream), "hipMemsetD8Async")

    def copy_to_device(self, ptr: int, host: np.ndarray) -> None:
        self._in_flight.append(host)
        check(self._hip, self._hip.hipMemcpyHtoDAsync(ptr, host.ctypes.data, host.nbytes, self._stream),
              "hipMemcpyHtoDAsync")
        if host.nbytes >= SYNC_UPLOAD_BYTES:
            self.synchronize()

    def copy_to_host(self, host: np.ndarray, ptr: int) -> None:
        check(self._hip, self._hip.hipMemcpyDtoHAsync(host.ctypes.data, ptr, host.nbytes, self._stream),
              "hipMemcpyDtoHAsync")
        self.synchronize()

    def synchronize(self) -> None:
        check(self._hip, self._hip.hipStreamSynchronize(self._stream), "hipStreamSynchronize")
        self._in_flight.clear()

    def load_module(self, artifacts: Artifacts) -> Any:
        return check(self._hip, self._hip.hipModuleLoadData(artifacts["code_object"]), "hipModuleLoadData")

    def get_function(self, module: Any, name: str) -> Any:
        return check(self._hip, self._hip.hipModuleGetFunction(module, name.encode()), f"hipModuleGetFunction({name})")

    def bind(self, function: Any, args: ctypes.Structure, layout: ParamLayout | None = None) -> BoundLaunch:
        # The parameters, laid out as the kernel expects them, are the struct's first bytes.
        size = ctypes.c_size_t(params_size(args, layout))
        extra = (ctypes.c_void_p * 5)(
            HIP_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(args), HIP_LAUNCH_PARAM_BUFFER_SIZE,
            ctypes.addressof(size), HIP_LAUNCH_PARAM_END,
        )
        address = ctypes.addressof(extra)
        launch_kernel = self._hip.hipModuleLaunchKernel
        stream, ok, keep = self._stream, self._ok, (extra, size, args)

        def launch(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, _keep: object = keep) -> None:
            (err,) = launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, None, address)
            if err != ok:
                raise GpuError(f"hipModuleLaunchKernel(grid={(gx, gy, gz)}, block={(bx, by, bz)}, "
                               f"shared={shared}) failed: {err}")

        return launch
