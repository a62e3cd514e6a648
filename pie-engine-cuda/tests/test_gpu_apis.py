"""The CUDA and HIP API layers over fake drivers: what they ask the driver, how launches pass the
argument struct, and how failures surface. (The real drivers are exercised by test_gpu.py.)"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from pie.plugins import DeviceLost
from pie_engine_cuda import driver_api
from pie_engine_cuda.api import SYNC_UPLOAD_BYTES, GpuError
from pie_engine_cuda.args import STRUCTS
from pie_engine_cuda.tensor import OutOfDeviceMemory

GemmArgs = STRUCTS["GemmArgs"]

driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
R = driver.CUresult
A = driver.CUdevice_attribute


class FakeCuda:
    """Just enough of cuda.bindings.driver, returning (CUresult, *values) like the real one."""

    CUresult = R
    CUdevice_attribute = A

    def __init__(self, driver_version: int = 13000, memory: int = 1 << 30):
        self.driver_version = driver_version
        self.memory = memory
        self.used = 0
        self.current = False
        self.launches: list[dict[str, Any]] = []
        self.syncs = 0
        self.copies: list[tuple[str, int, int]] = []
        self.fail_launch: Any = None

    def cuInit(self, flags: int) -> tuple:
        return (R.CUDA_SUCCESS,)

    def cuDriverGetVersion(self) -> tuple:
        return (R.CUDA_SUCCESS, self.driver_version)

    def cuDeviceGetCount(self) -> tuple:
        return (R.CUDA_SUCCESS, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple:
        return (R.CUDA_SUCCESS, f"device{ordinal}")

    def cuDeviceGetAttribute(self, attribute: Any, device: Any) -> tuple:
        values = {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                  A.CU_DEVICE_ATTRIBUTE_WARP_SIZE: 32, A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
                  A.CU_DEVICE_ATTRIBUTE_INTEGRATED: 0}
        return (R.CUDA_SUCCESS, values[attribute])

    def cuDeviceGetName(self, length: int, device: Any) -> tuple:
        return (R.CUDA_SUCCESS, b"NVIDIA H200".ljust(length, b"\0"))

    def cuDeviceTotalMem(self, device: Any) -> tuple:
        return (R.CUDA_SUCCESS, 150_000_000_000)

    def cuDevicePrimaryCtxRetain(self, device: Any) -> tuple:
        return (R.CUDA_SUCCESS, "context")

    def cuCtxSetCurrent(self, context: Any) -> tuple:
        self.current = True
        return (R.CUDA_SUCCESS,)

    def cuStreamCreate(self, flags: int) -> tuple:
        return (R.CUDA_SUCCESS, "stream")

    def cuMemAlloc(self, nbytes: int) -> tuple:
        if not self.current:
            return (R.CUDA_ERROR_INVALID_CONTEXT, 0)
        if self.used + nbytes > self.memory:
            return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)
        self.used += nbytes
        return (R.CUDA_SUCCESS, 0x7000_0000 + self.used)

    def cuMemcpyHtoDAsync(self, ptr: int, host: int, nbytes: int, stream: Any) -> tuple:
        self.copies.append(("htod", ptr, nbytes))
        return (R.CUDA_SUCCESS,)

    def cuStreamSynchronize(self, stream: Any) -> tuple:
        self.syncs += 1
        return (R.CUDA_SUCCESS,)

    def cuLaunchKernel(self, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: Any, params: int, extra: int) -> tuple:
        if not self.current:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        if self.fail_launch is not None:
            return (self.fail_launch,)
        struct_address = ctypes.c_void_p.from_address(params).value
        self.launches.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
                              "stream": stream, "args": ctypes.string_at(struct_address, ctypes.sizeof(GemmArgs))})
        return (R.CUDA_SUCCESS,)

    def cuGetErrorName(self, err: Any) -> tuple:
        return (R.CUDA_SUCCESS, err.name.encode())

    def cuGetErrorString(self, err: Any) -> tuple:
        return (R.CUDA_SUCCESS, b"fake failure")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(driver_api, "driver_module", lambda: fake)
    return fake


def _nvrtc_or_skip() -> None:
    from pie_engine_cuda.compiler import Nvrtc

    try:
        Nvrtc().version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC is not available: {exc}")


def test_probe_describes_the_gpu_and_its_compile_target(fake: FakeCuda) -> None:
    _nvrtc_or_skip()
    (facts,) = driver_api.probe_cuda()
    assert (facts.name, facts.vendor, facts.architecture, facts.compile_target) == ("NVIDIA H200", "NVIDIA", "sm_90", "sm_90")
    assert facts.tensor_cores and facts.warp_size == 32 and facts.multiprocessors == 132
    assert facts.driver == "CUDA 13.0" and facts.memory_bytes == 150_000_000_000
    assert dict(facts.details)["compute_capability"] == "9.0"


def test_a_driver_older_than_nvrtc_is_refused_with_the_fix(fake: FakeCuda) -> None:
    _nvrtc_or_skip()
    fake.driver_version = 12040
    from pie_engine_cuda.compiler import Nvrtc

    if int(Nvrtc().version.split(".")[0]) <= 12:
        pytest.skip("NVRTC is not newer than CUDA 12 here")
    with pytest.raises(driver_api.DriverUnavailable, match=r"pie-engine-cuda\[cu12\]"):
        driver_api.probe_cuda()


def _facts() -> Any:
    return SimpleNamespace(ordinal=0, warp_size=32)


def test_a_bound_launch_passes_the_struct_and_survives_a_new_thread(fake: FakeCuda) -> None:
    api = driver_api.CudaApi(_facts())
    args = GemmArgs()
    launch = api.bind("gemv_f32", args)
    args.x, args.rows, args.k = 0x1234, 3, 64
    launch(10, 1, 1, 128, 1, 1, 0)
    fake.current = False  # as if another thread, without the context current, launched
    args.rows = 5
    launch(10, 2, 1, 128, 1, 1, 512)
    first, second = fake.launches
    assert first["grid"] == (10, 1, 1) and first["block"] == (128, 1, 1) and first["stream"] == "stream"
    assert first["args"][:8] == (0x1234).to_bytes(8, "little")
    assert int.from_bytes(first["args"][GemmArgs.rows.offset : GemmArgs.rows.offset + 4], "little") == 3
    assert int.from_bytes(second["args"][GemmArgs.rows.offset : GemmArgs.rows.offset + 4], "little") == 5
    assert second["shared"] == 512 and fake.current


def test_a_failed_launch_names_its_configuration(fake: FakeCuda) -> None:
    api = driver_api.CudaApi(_facts())
    launch = api.bind("f", GemmArgs())
    fake.fail_launch = R.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    configuration = r"grid=\(7, 1, 1\), block=\(256, 1, 1\).*CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
    with pytest.raises(GpuError, match=configuration) as failed:
        launch(7, 1, 1, 256, 1, 1, 0)
    assert not isinstance(failed.value, DeviceLost), "a launch too large for the GPU leaves the GPU usable"


def test_a_fault_that_poisons_the_context_is_a_device_lost(fake: FakeCuda) -> None:
    """pie serve stops serving on a DeviceLost; as a plain GpuError, every request after an illegal address failed."""
    api = driver_api.CudaApi(_facts())
    fake.fail_launch = R.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(DeviceLost, match=r"grid=\(7, 1, 1\).*CUDA_ERROR_ILLEGAL_ADDRESS.*cannot be used again") as lost:
        api.bind("f", GemmArgs())(7, 1, 1, 256, 1, 1, 0)
    assert isinstance(lost.value, GpuError)
    hip_fault = SimpleNamespace(name="hipErrorIllegalAddress")
    for sticky in (R.CUDA_ERROR_ECC_UNCORRECTABLE, R.CUDA_ERROR_LAUNCH_FAILED, hip_fault):
        with pytest.raises(DeviceLost):
            driver_api.check(fake, (sticky,), "cuStreamSynchronize")


def test_raw_launches_go_straight_to_libcuda_only_under_cuda_python(fake: FakeCuda) -> None:
    assert driver_api.raw_launcher(fake) is None
    try:
        ctypes.CDLL("libcuda.so.1")
        has_libcuda = True
    except OSError:
        has_libcuda = False
    assert (driver_api.raw_launcher(driver) is not None) == has_libcuda


def test_a_raw_launch_passes_handles_and_the_struct_and_names_a_failure(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple] = []

    def raw(*call: Any) -> int:
        calls.append(call)
        return 0 if len(calls) == 1 else int(R.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)

    monkeypatch.setattr(driver_api, "raw_launcher", lambda _driver: raw)
    monkeypatch.setattr(fake, "cuStreamCreate", lambda flags: (R.CUDA_SUCCESS, 0x57))
    api = driver_api.CudaApi(_facts())
    args = GemmArgs()
    launch = api.bind(0xF00, args)
    launch(3, 1, 1, 128, 1, 1, 64)
    (first,) = calls
    handles = [value.value if isinstance(value, ctypes.c_void_p) else value for value in first]
    assert handles[:9] == [0xF00, 3, 1, 1, 128, 1, 1, 64, 0x57] and handles[10] is None
    assert ctypes.cast(handles[9], ctypes.POINTER(ctypes.c_void_p))[0] == ctypes.addressof(args)
    with pytest.raises(GpuError, match=r"grid=\(5, 1, 1\).*CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        launch(5, 1, 1, 128, 1, 1, 0)


def test_out_of_memory_is_its_own_error(fake: FakeCuda) -> None:
    api = driver_api.CudaApi(_facts())
    api.mem_alloc(1 << 29)
    with pytest.raises(OutOfDeviceMemory):
        api.mem_alloc(1 << 30)


def test_small_uploads_stay_queued_and_large_ones_wait(fake: FakeCuda) -> None:
    api = driver_api.CudaApi(_facts())
    small = np.arange(16, dtype=np.int32)
    api.copy_to_device(0x10, small)
    assert fake.syncs == 0 and api._in_flight == [small]
    api.copy_to_device(0x20, np.zeros(SYNC_UPLOAD_BYTES // 4, np.float32))
    assert fake.syncs == 1 and api._in_flight == []


# -- HIP -------------------------------------------------------------------------------


class FakeHip:
    hipError_t = SimpleNamespace(hipSuccess=0, hipErrorNoDevice=100, hipErrorInvalidDevice=101, hipErrorOutOfMemory=2)
    hipDeviceAttribute_t = SimpleNamespace(hipDeviceAttributeWarpSize="warp", hipDeviceAttributeMultiprocessorCount="cus",
                                           hipDeviceAttributeIntegrated="integrated")

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def hipInit(self, flags: int) -> tuple:
        return (0,)

    def hipGetDeviceCount(self) -> tuple:
        return (0, 1)

    def hipDriverGetVersion(self) -> tuple:
        return (0, 60342131)

    def hipDeviceGetAttribute(self, attribute: str, ordinal: int) -> tuple:
        return (0, {"warp": 64, "cus": 104, "integrated": 0}[attribute])

    def hipGetDeviceProperties(self, ordinal: int) -> tuple:
        return (0, SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-"))

    def hipDeviceGetName(self, length: int, ordinal: int) -> tuple:
        return (0, b"AMD Instinct MI210\0")

    def hipDeviceTotalMem(self, ordinal: int) -> tuple:
        return (0, 64 << 30)

    def hipSetDevice(self, ordinal: int) -> tuple:
        return (0,)

    def hipStreamCreate(self) -> tuple:
        return (0, "hip-stream")

    def hipModuleLaunchKernel(self, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                              stream: Any, params: Any, extra: int) -> tuple:
        config = (ctypes.c_void_p * 5).from_address(extra)
        size = ctypes.c_size_t.from_address(config[3]).value
        self.launches.append((config[0], config[2], config[4], ctypes.string_at(config[1], size), (gx, gy, gz), stream))
        return (0,)


def test_hip_probe_reads_the_gcn_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    from pie_engine_cuda.compiler import Hiprtc

    try:
        Hiprtc().version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"hiprtc is not available: {exc}")
    monkeypatch.setattr(driver_api, "hip_module", FakeHip)
    (facts,) = driver_api.probe_hip()
    assert (facts.name, facts.vendor, facts.architecture) == ("AMD Instinct MI210", "AMD", "gfx90a")
    assert facts.compile_target == "gfx90a:sramecc+:xnack-" and facts.warp_size == 64 and not facts.tensor_cores


def test_hip_launches_pass_the_struct_through_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHip()
    monkeypatch.setattr(driver_api, "hip_module", lambda: fake)
    api = driver_api.HipApi(SimpleNamespace(ordinal=0, warp_size=64))
    args = GemmArgs()
    args.rows = 9
    api.bind("gemm_f32", args)(3, 2, 1, 256, 1, 1, 0)
    pointer_tag, size_tag, end_tag, payload, grid, stream = fake.launches[0]
    assert (pointer_tag, size_tag, end_tag) == (1, 2, 3) and grid == (3, 2, 1) and stream == "hip-stream"
    assert payload == bytes(args) and len(payload) == ctypes.sizeof(GemmArgs)
    # Several parameters: the buffer ends with the last one, not at the struct's padded size.
    api.bind("eta", args, ((0, 8), (8, 8), (16, 12)))(1, 1, 1, 256, 1, 1, 0)
    assert len(fake.launches[1][3]) == 28
