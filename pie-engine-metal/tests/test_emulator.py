"""The CPU emulator must catch what would go wrong on a GPU, or its green results would mean little.

A small MSL file of deliberately right and wrong kernels runs through the same driver
the engine tests use.
"""

from __future__ import annotations

import numpy as np
import pytest
from msl_emulator.driver import EmulatedDriver, EmulatorError

from pie_engine_metal.library import Constant

SOURCE = """
#include <metal_stdlib>
using namespace metal;

constant uint offset [[function_constant(0)]];

struct Count {
    uint n;
};

kernel void lanes(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                  uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    out[tid * 4 + 0] = simd_sum(lane);
    out[tid * 4 + 1] = simd_max(lane) + offset;
    out[tid * 4 + 2] = simd_shuffle_down(lane, 1);
    out[tid * 4 + 3] = simd_shuffle_xor(lane, 1);
}

kernel void reductions(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                       uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    out[tid * 4 + 0] = simd_sum(lane);
    out[tid * 4 + 1] = simd_max(lane) + offset;
}

kernel void neighbours(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                       uint tid [[thread_position_in_threadgroup]], uint count [[threads_per_threadgroup]])
{
    threadgroup uint shared[256];
    shared[tid] = tid + 1;
    if (p.n != 0u) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[tid] = shared[(tid + 1) % count];
}

kernel void early_return(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                         uint tid [[thread_position_in_threadgroup]])
{
    threadgroup uint shared[64];
    if (tid == 0) {
        return;
    }
    shared[tid] = tid;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = shared[tid];
}

kernel void split(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                  uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    if (lane < 4) {
        out[tid] = simd_sum(1u);
    } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}

kernel void mixed(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                  uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    out[tid] = lane < 4 ? simd_sum(lane) : simd_max(lane);
}

kernel void inactive(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                     uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    if (lane >= 4) {
        return;
    }
    out[tid] = simd_shuffle(lane, 10);
}

kernel void overrun(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                    uint gid [[thread_position_in_grid]])
{
    out[gid] = p.n;
}

kernel void divide(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                   uint gid [[thread_position_in_grid]])
{
    out[gid] = 7u / p.n;
}

kernel void forever(device uint* out [[buffer(0)]], constant Count& p [[buffer(1)]],
                    uint gid [[thread_position_in_grid]])
{
    while (((volatile device uint*)out)[0] == 0u) {
    }
}
"""

OFFSET = Constant(0, "offset", "uint")


@pytest.fixture(scope="module")
def library():
    return EmulatedDriver(32).compile_library("emulator_checks", SOURCE)


def _run(
    library,
    kernel: str,
    threads: int,
    n: int = 1,
    *,
    width: int = 32,
    seed: int = 0,
    out_words: int | None = None,
    groups: int = 1,
    timeout_s: int = 60,
) -> np.ndarray:
    driver = EmulatedDriver(width, seed=seed, timeout_s=timeout_s)
    words = out_words if out_words is not None else threads * groups * 4
    out = driver.new_buffer(words * 4)
    np.frombuffer(driver.contents(out, words * 4), np.uint32)[:] = 0
    pipeline = driver.new_pipeline(library, kernel, [(OFFSET, 100)])
    driver.encode(pipeline, [(out, 0)], np.array([n], np.uint32).tobytes(), (groups, 1, 1), (threads, 1, 1))
    driver.commit()
    driver.wait()
    return np.frombuffer(driver.contents(out, words * 4), np.uint32).copy()


@pytest.mark.parametrize("width", [16, 32, 64])
def test_simd_functions_and_function_constants(library, width: int) -> None:
    got = _run(library, "lanes", 2 * width, width=width).reshape(-1, 4)
    lanes = np.arange(2 * width) % width
    assert (got[:, 0] == width * (width - 1) // 2).all()
    assert (got[:, 1] == width - 1 + 100).all()
    assert (got[:, 2] == np.where(lanes + 1 < width, lanes + 1, lanes)).all()
    assert (got[:, 3] == lanes ^ 1).all()


@pytest.mark.parametrize("width", [16, 32])
def test_reductions_cover_only_the_lanes_of_a_partial_simdgroup(library, width: int) -> None:
    threads = width + 8  # a full simdgroup, then one of 8 lanes
    got = _run(library, "reductions", threads, width=width).reshape(-1, 4)[:threads]
    assert (got[:width, 0] == width * (width - 1) // 2).all() and (got[width:, 0] == 28).all()
    assert (got[:width, 1] == width - 1 + 100).all() and (got[width:, 1] == 7 + 100).all()


@pytest.mark.parametrize("seed", [0, 5])
def test_threadgroup_memory_is_shared_after_a_barrier(library, seed: int) -> None:
    got = _run(library, "neighbours", 96, n=1, seed=seed)[:96]
    assert (got == (np.arange(96) + 1) % 96 + 1).all()


def test_reading_threadgroup_memory_without_a_barrier_sees_poison(library) -> None:
    got = _run(library, "neighbours", 96, n=0)[:96]
    assert (got[:-1] == 0xFFFFFFFF).all(), (
        "threads ran in order, so each read its neighbour's slot before it was written"
    )


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        ("early_return", "divergent threadgroup barrier"),
        ("split", "deadlock"),
        ("mixed", "different collectives"),
        ("inactive", "inactive lane"),
        ("divide", "arithmetic trap"),
    ],
)
def test_gpu_mistakes_fail_the_launch(library, kernel: str, message: str) -> None:
    with pytest.raises(EmulatorError, match=message):
        _run(library, kernel, 64, n=0)


def test_an_overrun_names_the_buffer_and_byte(library) -> None:
    with pytest.raises(EmulatorError, match=r"memory fault .* at byte 256 of buffer 0 \(out\)"):
        _run(library, "overrun", 32, groups=3, out_words=64)


def test_the_watchdog_ends_a_kernel_that_never_returns(library) -> None:
    with pytest.raises(EmulatorError, match="watchdog"):
        _run(library, "forever", 1, timeout_s=1)


def test_a_params_struct_larger_than_what_was_bound_is_refused(library) -> None:
    driver = EmulatedDriver(32)
    out = driver.new_buffer(64)
    pipeline = driver.new_pipeline(library, "overrun", [(OFFSET, 0)])
    driver.encode(pipeline, [(out, 0)], b"", (1, 1, 1), (4, 1, 1))
    driver.commit()
    with pytest.raises(EmulatorError, match="params are smaller"):
        driver.wait()


def test_work_runs_only_when_the_host_waits(library) -> None:
    driver = EmulatedDriver(32)
    out = driver.new_buffer(16)
    view = np.frombuffer(driver.contents(out, 16), np.uint32)
    view[:] = 0
    pipeline = driver.new_pipeline(library, "overrun", [(OFFSET, 0)])
    driver.encode(pipeline, [(out, 0)], np.array([9], np.uint32).tobytes(), (1, 1, 1), (4, 1, 1))
    driver.commit()
    assert (view == 0).all()
    driver.wait()
    assert (view == 9).all()
