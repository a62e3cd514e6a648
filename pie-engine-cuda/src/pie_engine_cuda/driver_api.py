"""The GPU driver APIs: CUDA through ``cuda.bindings.driver`` (cuda-python), HIP through hip-python.

hip-python mirrors cuda-python: the same calls under another prefix (``cuMemsetD8Async``,
``hipMemsetD8Async``), each returning ``(error, *values)``. :class:`DriverApi` makes every call
the two share once, by name without its prefix; :class:`CudaApi` and :class:`HipApi` add what
really differs: CUDA's primary context and its launch through ``kernelParams`` (straight to
libcuda when it can), HIP's current device and its launch through ``extra``
(HIP_LAUNCH_PARAM_BUFFER_POINTER, which every ROCm release accepts for module launches).
hip-python's version must match the installed ROCm (its own requirement); the kernels come
from hiprtc (:mod:`pie_engine_cuda.hiprtc_lib`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from pie_engine_cuda.api import (
    SYNC_UPLOAD_BYTES,
    BoundLaunch,
    DeviceFacts,
    GpuError,
    ParamLayout,
    kernel_params,
    params_size,
)
from pie.enginekit.compile_cache import Artifacts
from pie.plugins import DeviceLost
from pie_engine_cuda.tensor import OutOfDeviceMemory

FIX_CUDA_PYTHON = "pip install cuda-python"
FIX_NVRTC = "pip install nvidia-cuda-nvrtc   # CUDA 12 drivers: pip install 'pie-engine-cuda[cu12]'"
FIX_DRIVER = (
    "sudo ubuntu-drivers install   # or: sudo apt-get install nvidia-driver-570, then reboot; "
    "in a container: docker run --gpus all ..."
)
FIX_NO_GPU = "nvidia-smi must list the GPU: sudo modprobe nvidia, check dmesg; in a container pass --gpus all"
FIX_HIP_PYTHON = "pip install 'pie-engine-cuda[rocm]'   # hip-python matching your ROCm version"
FIX_HIPRTC = "install ROCm (https://rocm.docs.amd.com), e.g. sudo apt-get install libamdhip64-dev"
FIX_AMD_GPU = "rocminfo must list the GPU: load the amdgpu driver and add your user to the render and video groups"
NO_DRIVER = (
    "the NVIDIA driver library libcuda.so.1 was not found: no NVIDIA driver is installed or visible here "
    "(install one, e.g. `sudo ubuntu-drivers install` or `sudo apt-get install nvidia-driver-570`, then reboot; "
    "in a container run with `--gpus all`)"
)
NO_HIP_RUNTIME = (
    "the HIP runtime (libamdhip64.so) cannot be loaded ({}): install ROCm "
    "(https://rocm.docs.amd.com), or `apt-get install libamdhip64-dev` on Debian/Ubuntu"
)
HIP_LAUNCH_PARAM_BUFFER_POINTER = 0x01
HIP_LAUNCH_PARAM_BUFFER_SIZE = 0x02
HIP_LAUNCH_PARAM_END = 0x03
STICKY_ERRORS = frozenset({
    # CUDA's driver API documents each as leaving the process in an inconsistent state: every later call returns the
    # same error, and only a new process can use the GPU again.
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_NVLINK_UNCORRECTABLE",
    "CUDA_ERROR_CONTAINED",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_EXTERNAL_DEVICE",
    # HIP's counterparts of those it has.
    "hipErrorECCNotCorrectable",
    "hipErrorIllegalAddress",
    "hipErrorLaunchTimeOut",
    "hipErrorAssert",
    "hipErrorLaunchFailure",
})
"""The driver errors (by name, in either binding) after which the device's context cannot be used again."""


class GpuLost(GpuError, DeviceLost):
    """A driver call failed with one of STICKY_ERRORS: the GPU cannot be used again by this process."""


class DriverUnavailable(RuntimeError):
    """cuda-python, hip-python, a compiler or the driver is missing or unusable: ``what`` names it as
    ``pie doctor`` does, ``fix`` says how to fix it."""

    def __init__(self, message: str, what: str, fix: str):
        super().__init__(message)
        self.what, self.fix = what, fix


def driver_module() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DriverUnavailable(f"cuda-python is not installed ({exc}): `{FIX_CUDA_PYTHON}`", "cuda-python",
                                FIX_CUDA_PYTHON) from exc
    return driver


def hip_module() -> Any:
    try:
        from hip import hip
    except ImportError as exc:
        raise DriverUnavailable(f"hip-python is not installed ({exc}): `pip install 'pie-engine-cuda[rocm]'`",
                                "hip-python (AMD GPUs)", FIX_HIP_PYTHON) from exc
    return hip


def init_driver(driver: Any) -> Any:
    """cuInit; the CUresult (CUDA_ERROR_NO_DEVICE included), or DriverUnavailable when libcuda is missing."""
    try:
        (err,) = driver.cuInit(0)
    except (RuntimeError, OSError) as exc:  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise DriverUnavailable(NO_DRIVER, "NVIDIA driver (libcuda.so.1)", FIX_DRIVER) from exc
    return err


def init_hip(hip: Any) -> Any:
    """hipInit; the hipError_t, or DriverUnavailable when hip-python cannot open libamdhip64."""
    try:
        (err,) = hip.hipInit(0)
    except RuntimeError as exc:
        raise DriverUnavailable(NO_HIP_RUNTIME.format(exc), "HIP runtime (libamdhip64)", FIX_HIPRTC) from exc
    return err


def error_text(driver: Any, err: Any) -> str:
    """A CUresult's name and description (a hipError_t prints as its name)."""
    try:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        return f"{name.decode()}: {text.decode()}"
    except Exception:  # noqa: BLE001 - describing an error must not raise another
        return str(err)


def failure(driver: Any, err: Any, what: str) -> GpuError:
    """The error to raise for ``what`` failing with ``err``: GpuLost where ``err`` leaves the context unusable."""
    message = f"{what} failed: {error_text(driver, err)}"
    if getattr(err, "name", None) in STICKY_ERRORS:
        return GpuLost(f"{message}; the GPU cannot be used again until pie restarts")
    return GpuError(message)


def check(driver: Any, result: tuple, what: str, success: Any = None) -> Any:
    """The values of a ``(error, *values)`` result (one, a tuple, or None); GpuError unless it succeeded."""
    err, *values = result
    if err != (driver.CUresult.CUDA_SUCCESS if success is None else success):
        raise failure(driver, err, what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def c_text(value: Any) -> str:
    """A C string from either binding (str, bytes or CStr) up to its terminating NUL."""
    text = value if isinstance(value, str) else bytes(value).decode(errors="replace")
    return text.split("\0", 1)[0]


def probe_cuda() -> list[DeviceFacts]:
    """Every CUDA device with what the engine needs to know; [] when the driver finds none."""
    from pie_engine_cuda.compiler import Nvrtc

    driver = driver_module()
    err = init_driver(driver)
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return []
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DriverUnavailable(f"cuInit failed: {error_text(driver, err)} (does `nvidia-smi` work?)", "NVIDIA GPU",
                                FIX_NO_GPU)
    try:
        nvrtc = Nvrtc()
        nvrtc_version = nvrtc.version
    except Exception as exc:
        raise DriverUnavailable(f"NVRTC cannot be loaded ({exc})", "NVRTC", FIX_NVRTC) from exc
    driver_version = check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
    driver_major = driver_version // 1000
    if driver_major < int(nvrtc_version.split(".")[0]):
        fix = f"update the NVIDIA driver, or: pip install 'pie-engine-cuda[cu{driver_major}]'"
        raise DriverUnavailable(
            f"NVRTC {nvrtc_version} emits code the driver (CUDA {driver_major}.{driver_version % 1000 // 10}) "
            f"cannot load: {fix}", "driver and NVRTC versions", fix,
        )
    attribute = driver.CUdevice_attribute
    devices = []
    for ordinal in range(check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount")):
        device = check(driver, driver.cuDeviceGet(ordinal), "cuDeviceGet")

        def get(attr: Any, device: Any = device) -> int:
            return int(check(driver, driver.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute"))

        major = get(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        target = nvrtc.target(major * 10 + minor)
        devices.append(
            DeviceFacts(
                ordinal=ordinal,
                name=c_text(check(driver, driver.cuDeviceGetName(256, device), "cuDeviceGetName")),
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


def probe_hip() -> list[DeviceFacts]:
    """Every AMD GPU HIP sees; [] when the runtime loads but finds none."""
    from pie_engine_cuda.compiler import Hiprtc

    hip = hip_module()
    ok = hip.hipError_t.hipSuccess
    err = init_hip(hip)
    if err in (hip.hipError_t.hipErrorNoDevice, hip.hipError_t.hipErrorInvalidDevice):
        return []
    if err != ok:
        raise DriverUnavailable(f"hipInit failed: {err} (does `rocminfo` list the GPU?)", "AMD GPU", FIX_AMD_GPU)
    count = check(hip, hip.hipGetDeviceCount(), "hipGetDeviceCount", ok)
    if not count:
        return []
    try:
        rtc = Hiprtc()
        rtc_version = rtc.version
    except Exception as exc:
        raise DriverUnavailable(f"hiprtc cannot be loaded: {exc}", "hiprtc", FIX_HIPRTC) from exc
    driver_version = check(hip, hip.hipDriverGetVersion(), "hipDriverGetVersion", ok)
    attribute = hip.hipDeviceAttribute_t
    devices = []
    for ordinal in range(count):

        def get(attr: Any, ordinal: int = ordinal) -> int:
            return int(check(hip, hip.hipDeviceGetAttribute(attr, ordinal), "hipDeviceGetAttribute", ok))

        arch_name = c_text(check(hip, hip.hipGetDeviceProperties(ordinal), "hipGetDeviceProperties", ok).gcnArchName)
        devices.append(
            DeviceFacts(
                ordinal=ordinal,
                name=c_text(check(hip, hip.hipDeviceGetName(256, ordinal), "hipDeviceGetName", ok)),
                vendor="AMD",
                architecture=arch_name.split(":", 1)[0],
                compile_target=arch_name,
                memory_bytes=int(check(hip, hip.hipDeviceTotalMem(ordinal), "hipDeviceTotalMem", ok)),
                driver=f"HIP {driver_version}",
                warp_size=get(attribute.hipDeviceAttributeWarpSize),
                multiprocessors=get(attribute.hipDeviceAttributeMultiprocessorCount),
                integrated=bool(get(attribute.hipDeviceAttributeIntegrated)),
                details=(("gcn_arch", arch_name), ("compiler", f"hiprtc {rtc_version} ({rtc.origin})")),
            )
        )
    return devices


def raw_launcher(driver: Any) -> Any:
    """libcuda's own cuLaunchKernel through ctypes, returning the CUresult as an int, when ``driver`` is
    cuda-python's module; None otherwise (a stand-in driver keeps its call).

    cuda-python's call converts the function and stream objects and builds a result tuple and enum
    on every launch; a decode step makes hundreds of launches. The function is called without
    argtypes (cheaper than converting eleven arguments): the handles and the parameter array go in
    as ``c_void_p`` made once per bound launch, the grid, block and shared-memory sizes as Python ints,
    which ctypes passes as C ints (every launch config stays below 2**31)."""
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


class DriverApi:
    """One device on one stream, through a binding whose calls are named ``prefix + name``.

    ``renamed`` maps the names where the binding departs from CUDA's (HIP's ``Malloc`` for ``MemAlloc``);
    a call failing with ``stale`` (CUDA's invalid context: a new thread) is retried once after
    :meth:`_make_current`.
    """

    backend: str
    prefix: str
    renamed: ClassVar[dict[str, str]] = {}

    def __init__(self, facts: DeviceFacts, module: Any, ok: Any, out_of_memory: Any, stale: Any = None):
        self.facts = facts
        self._driver = module
        self._ok, self._out_of_memory, self._stale = ok, out_of_memory, stale
        self._make_current()
        self._stream = self._call("StreamCreate", *self._stream_flags())
        self._in_flight: list[np.ndarray] = []

    def _stream_flags(self) -> tuple[int, ...]:
        return ()

    def _make_current(self) -> None:
        raise NotImplementedError

    def _result(self, name: str, *args: Any) -> tuple[str, tuple]:
        """A call's full name and its ``(error, *values)``, made in this device's context."""
        full = self.prefix + self.renamed.get(name, name)
        function: Callable[..., tuple] = getattr(self._driver, full)
        result = function(*args)
        if self._stale is not None and result[0] == self._stale:
            self._make_current()
            result = function(*args)
        return full, result

    def _call(self, name: str, *args: Any, what: str = "") -> Any:
        full, result = self._result(name, *args)
        return check(self._driver, result, what or full, self._ok)

    def mem_alloc(self, nbytes: int) -> int:
        full, result = self._result("MemAlloc", nbytes)
        if result[0] == self._out_of_memory:
            raise OutOfDeviceMemory(f"{full}({nbytes}) failed: out of memory")
        return int(check(self._driver, result, full, self._ok))

    def mem_free(self, ptr: int) -> None:
        self._call("MemFree", ptr)

    def memset_zero(self, ptr: int, nbytes: int) -> None:
        self._call("MemsetD8Async", ptr, 0, nbytes, self._stream)

    def copy_to_device(self, ptr: int, host: np.ndarray) -> None:
        self._in_flight.append(host)
        self._call("MemcpyHtoDAsync", ptr, host.ctypes.data, host.nbytes, self._stream)
        if host.nbytes >= SYNC_UPLOAD_BYTES:
            self.synchronize()

    def copy_to_host(self, host: np.ndarray, ptr: int) -> None:
        self._call("MemcpyDtoHAsync", host.ctypes.data, ptr, host.nbytes, self._stream)
        self.synchronize()

    def synchronize(self) -> None:
        self._call("StreamSynchronize", self._stream)
        self._in_flight.clear()

    def load_module(self, artifacts: Artifacts) -> Any:
        return self._call("ModuleLoadData", self._image(artifacts))

    def _image(self, artifacts: Artifacts) -> bytes:
        raise NotImplementedError

    def get_function(self, module: Any, name: str) -> Any:
        return self._call("ModuleGetFunction", module, name.encode(), what=f"{self.prefix}ModuleGetFunction({name})")

    def _launch_failed(self, err: Any, config: tuple[int, ...]) -> GpuError:
        name = self.prefix + self.renamed.get("LaunchKernel", "LaunchKernel")
        return failure(self._driver, err, f"{name}(grid={config[:3]}, block={config[3:6]}, shared={config[6]})")


class CudaApi(DriverApi):
    """One NVIDIA GPU: its primary context, one stream, module loading and bound launches."""

    backend = "cuda"
    prefix = "cu"

    def __init__(self, facts: DeviceFacts):
        driver = driver_module()
        result = driver.CUresult
        err = init_driver(driver)
        if err != result.CUDA_SUCCESS:
            raise GpuError(f"cuInit failed: {error_text(driver, err)}")
        device = check(driver, driver.cuDeviceGet(facts.ordinal), "cuDeviceGet")
        self._context = check(driver, driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        super().__init__(facts, driver, result.CUDA_SUCCESS, result.CUDA_ERROR_OUT_OF_MEMORY,
                         result.CUDA_ERROR_INVALID_CONTEXT)
        self._raw_launch = raw_launcher(driver)

    def _stream_flags(self) -> tuple[int, ...]:
        return (0,)

    def _make_current(self) -> None:
        check(self._driver, self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def _image(self, artifacts: Artifacts) -> bytes:
        return artifacts.get("cubin") or artifacts["ptx"]

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
        if err == self._stale:
            self._make_current()
            (err,) = self._driver.cuLaunchKernel(function, *config, self._stream, address, 0)
            if err == self._ok:
                return
        raise self._launch_failed(err, config)


class HipApi(DriverApi):
    """One AMD GPU: its current device, one stream, module loading and bound launches."""

    backend = "hip"
    prefix = "hip"
    renamed: ClassVar[dict[str, str]] = {"MemAlloc": "Malloc", "MemFree": "Free", "LaunchKernel": "ModuleLaunchKernel"}

    def __init__(self, facts: DeviceFacts):
        hip = hip_module()
        errors = hip.hipError_t
        err = init_hip(hip)
        if err != errors.hipSuccess:
            raise GpuError(f"hipInit failed: {err}")
        super().__init__(facts, hip, errors.hipSuccess, errors.hipErrorOutOfMemory)

    def _make_current(self) -> None:
        check(self._driver, self._driver.hipSetDevice(self.facts.ordinal), "hipSetDevice", self._ok)

    def _image(self, artifacts: Artifacts) -> bytes:
        return artifacts["code_object"]

    def bind(self, function: Any, args: ctypes.Structure, layout: ParamLayout | None = None) -> BoundLaunch:
        # The parameters, laid out as the kernel expects them, are the struct's first bytes.
        size = ctypes.c_size_t(params_size(args, layout))
        extra = (ctypes.c_void_p * 5)(
            HIP_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(args), HIP_LAUNCH_PARAM_BUFFER_SIZE,
            ctypes.addressof(size), HIP_LAUNCH_PARAM_END,
        )
        address = ctypes.addressof(extra)
        launch_kernel = self._driver.hipModuleLaunchKernel
        stream, ok, keep = self._stream, self._ok, (extra, size, args)

        def launch(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, _keep: object = keep) -> None:
            (err,) = launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, None, address)
            if err != ok:
                raise self._launch_failed(err, (gx, gy, gz, bx, by, bz, shared))

        return launch
