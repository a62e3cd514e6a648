"""The CUDA driver API through ``cuda.bindings.driver`` (cuda-python)."""

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
    kernel_params,
)
from pie.enginekit.compile_cache import Artifacts
from pie_engine_cuda.tensor import OutOfDeviceMemory

NO_DRIVER = (
    "the NVIDIA driver library libcuda.so.1 was not found: no NVIDIA driver is installed or visible here "
    "(install one, e.g. `sudo ubuntu-drivers install` or `sudo apt-get install nvidia-driver-570`, then reboot; "
    "in a container run with `--gpus all`)"
)


class CudaUnavailable(RuntimeError):
    """cuda-python, NVRTC or the NVIDIA driver is missing or unusable; the message says which and how to fix it."""


def driver_module() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaUnavailable(f"cuda-python is not installed ({exc}): `pip install cuda-python`") from exc
    return driver


def init_driver(driver: Any) -> Any:
    """cuInit; the CUresult (CUDA_ERROR_NO_DEVICE included), or CudaUnavailable when libcuda is missing."""
    try:
        (err,) = driver.cuInit(0)
    except (RuntimeError, OSError) as exc:  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise CudaUnavailable(NO_DRIVER) from exc
    return err


def error_text(driver: Any, err: Any) -> str:
    try:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        return f"{name.decode()}: {text.decode()}"
    except Exception:  # noqa: BLE001 - describing an error must not raise another
        return str(err)


def check(driver: Any, result: tuple, what: str) -> Any:
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GpuError(f"{what} failed: {error_text(driver, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def probe_cuda() -> list[DeviceFacts]:
    """Every CUDA device with what the engine needs to know; [] when the driver finds none."""
    from pie_engine_cuda.compiler import Nvrtc

    driver = driver_module()
    err = init_driver(driver)
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return []
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaUnavailable(f"cuInit failed: {error_text(driver, err)} (does `nvidia-smi` work?)")
    try:
        nvrtc = Nvrtc()
        nvrtc_version = nvrtc.version
    except Exception as exc:
        raise CudaUnavailable(f"NVRTC cannot be loaded ({exc}): `pip install nvidia-cuda-nvrtc`") from exc
    driver_version = check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
    driver_major = driver_version // 1000
    if driver_major < int(nvrtc_version.split(".")[0]):
        raise CudaUnavailable(
            f"NVRTC {nvrtc_version} emits code the driver (CUDA {driver_major}.{driver_version % 1000 // 10}) "
            f"cannot load: update the driver, or `pip install 'pie-engine-cuda[cu{driver_major}]'`"
        )
    attribute = driver.CUdevice_attribute
    devices = []
    for ordinal in range(check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount")):
        device = check(driver, driver.cuDeviceGet(ordinal), "cuDeviceGet")

        def get(attr: Any, device: Any = device) -> int:
            return int(check(driver, driver.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute"))

        major = get(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        name = check(driver, driver.cuDeviceGetName(256, device), "cuDeviceGetName")
        target = nvrtc.target(major * 10 + minor)
        devices.append(
            DeviceFacts(
                ordinal=ordinal,
                name=bytes(name).split(b"\0", 1)[0].decode(errors="replace"),
                vendor="NVIDIA",
                architecture=f"sm_{major}{minor}",
                compile_target=target,
                memory_bytes=int(check(driver, driver.cuDeviceTotalMem(device), "cuDeviceTotalMem")),
                driver=f"CUDA {driver_major}.{driver_version % 1000 // 10}",
                warp_size=get(attribute.CU_DEVICE_ATTRIBUTE_WARP_SIZE),
                multiprocessors=get(attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                integrated=bool(get(attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED)),
                tensor_cores=major >= 8 and int(target.split("_")[1]) >= 80,
                details=(("compute_capability", f"{major}.{minor}"), ("compiler", f"NVRTC {nvrtc_version}")),
            )
        )
    return devices


def raw_launcher(driver: Any) -> Any:
    """libcuda's own cuLaunchKernel through ctypes, returning the CUresult as an int, when ``driver`` is
    cuda-python's module; None otherwise (a stand-in driver keeps its call).

    cuda-python's call converts the function and stream objects and builds a result tuple and enum
    on every launch; a decode step makes hundreds of launches. The function is called without
    argtypes (a third of the cost of converting eleven arguments): the handles and the parameter
    array go in as ``c_void_p`` made once per bound launch, the grid, block and shared-memory sizes
    as Python ints, which ctypes passes as C ints (every launch config stays below 2**31)."""
    try:
        from cuda.bindings import driver as real_driver
    except ImportError:
        return None
    if driver is not real_driver:
        return None
    try:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    return launch


class CudaApi:
    """One device: its primary context, one stream, module loading and bound launches."""

    backend = "cuda"

    def __init__(self, facts: DeviceFacts):
        driver = driver_module()
        self._driver = driver
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._invalid_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        self.facts = facts
        err = init_driver(driver)
        if err != self._ok:
            raise GpuError(f"cuInit failed: {error_text(driver, err)}")
        self._device = check(driver, driver.cuDeviceGet(facts.ordinal), "cuDeviceGet")
        self._context = check(driver, driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self._make_current()
        self._stream = check(driver, driver.cuStreamCreate(0), "cuStreamCreate")
        self._in_flight: list[np.ndarray] = []
        self._raw_launch = raw_launcher(driver)

    def _make_current(self) -> None:
        check(self._driver, self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def _call(self, what: str, function: Any, *args: Any) -> Any:
        """A driver call in this device's context (made current when a new thread calls first)."""
        result = function(*args)
        if result[0] == self._invalid_context:
            self._make_current()
            result = function(*args)
        return check(self._driver, result, what)

    def mem_alloc(self, nbytes: int) -> int:
        result = self._driver.cuMemAlloc(nbytes)
        if result[0] == self._invalid_context:
            self._make_current()
            result = self._driver.cuMemAlloc(nbytes)
        if result[0] == self._driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfDeviceMemory(f"cuMemAlloc({nbytes}) failed: out of memory")
        return int(check(self._driver, result, "cuMemAlloc"))

    def mem_free(self, ptr: int) -> None:
        self._call("cuMemFree", self._driver.cuMemFree, ptr)

    def memset_zero(self, ptr: int, nbytes: int) -> None:
        self._call("cuMemsetD8Async", self._driver.cuMemsetD8Async, ptr, 0, nbytes, self._stream)

    def copy_to_device(self, ptr: int, host: np.ndarray) -> None:
        self._in_flight.append(host)
        self._call("cuMemcpyHtoDAsync", self._driver.cuMemcpyHtoDAsync, ptr, host.ctypes.data, host.nbytes, self._stream)
        if host.nbytes >= SYNC_UPLOAD_BYTES:
            self.synchronize()

    def copy_to_host(self, host: np.ndarray, ptr: int) -> None:
        self._call("cuMemcpyDtoHAsync", self._driver.cuMemcpyDtoHAsync, host.ctypes.data, ptr, host.nbytes, self._stream)
        self.synchronize()

    def synchronize(self) -> None:
        self._call("cuStreamSynchronize", self._driver.cuStreamSynchronize, self._stream)
        self._in_flight.clear()

    def load_module(self, artifacts: Artifacts) -> Any:
        image = artifacts.get("cubin") or artifacts["ptx"]
        return self._call("cuModuleLoadData", self._driver.cuModuleLoadData, image)

    def get_function(self, module: Any, name: str) -> Any:
        return self._call(f"cuModuleGetFunction({name})", self._driver.cuModuleGetFunction, module, name.encode())

    def bind(self, function: Any, args: ctypes.Structure, layout: ParamLayout | None = None) -> BoundLaunch:
        address, params = kernel_params(args, layout)
        keep = (params, args)
        raw = self._raw_launch
        if raw is not None:
            function_handle, stream_handle = ctypes.c_void_p(int(function)), ctypes.c_void_p(int(self._stream))
            params_pointer, result = ctypes.c_void_p(address), self._driver.CUresult

            def raw_launch(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                           _keep: object = keep) -> None:
                err = raw(function_handle, gx, gy, gz, bx, by, bz, shared, stream_handle, params_pointer, None)
                if err:
                    self._relaunch(result(err), function, (gx, gy, gz, bx, by, bz, shared), address)

            return raw_launch
        launch_kernel = self._driver.cuLaunchKernel
        stream, ok = self._stream, self._ok

        def launch(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, _keep: object = keep) -> None:
            (err,) = launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, address, 0)
            if err != ok:
                self._relaunch(err, function, (gx, gy, gz, bx, by, bz, shared), address)

        return launch

    def _relaunch(self, err: Any, function: Any, config: tuple[int, ...], address: int) -> None:
        """The cold path of a failed launch: retry in this context once, else raise with the shapes."""
        if err == self._invalid_context:
            self._make_current()
            (err,) = self._driver.cuLaunchKernel(function, *config, self._stream, address, 0)
            if err == self._ok:
                return
        raise GpuError(f"cuLaunchKernel(grid={config[:3]}, block={config[3:6]}, shared={config[6]}) failed: "
                       f"{error_text(self._driver, err)}")
