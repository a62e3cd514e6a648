"""The engine's host side on the emulated device: bindings, pipelines, batching, buffer reuse, pages."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from msl_emulator.driver import unpack_params
from msl_emulator.engine import MAC2, FakeMTLDevice
from pie import kernels
from pie.contract import KernelRequest, PageLayout, PassPlan
from pie.plugins import EngineError

from pie_engine_metal import plan

F32 = np.float32


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(F32)


# -- bindings -------------------------------------------------------------------


def test_projection_binds_inputs_in_kernel_order_with_placeholders(open_emulated, rng) -> None:
    emu = open_emulated()
    device, driver = emu.device, emu.driver
    x, w, b = (device.upload(a) for a in (_f32(rng, 1, 64), _f32(rng, 96, 64), _f32(rng, 96)))
    out = device.compile("linear", "gemv")(x, w, b)
    call = driver.log[-1]
    assert call.function == "linear_gemv"
    assert call.constants == {"has_bias": True, "has_norm": False, "gated": False, "has_residual": False, "weight_type": 0}
    buffers = [buffer for buffer, _ in call.buffers]
    placeholder = emu.context.placeholder
    assert buffers == [x.buffer, w.buffer, b.buffer, placeholder, placeholder, placeholder, out.buffer]
    assert unpack_params(call) == (1, 64, 96)
    assert (call.groups, call.threads) == plan.grid_linear("gemv", 1, 96, 32)

    device.compile("linear")(x, w, None)
    assert driver.log[-1].constants["has_bias"] is False
    assert driver.log[-1].buffers[2][0] is placeholder


def test_fused_norm_projection_runs_its_prologue_first(open_emulated, rng) -> None:
    emu = open_emulated()
    device, driver = emu.device, emu.driver
    x, g, w = (device.upload(a) for a in (_f32(rng, 12, 64), _f32(rng, 64), _f32(rng, 2 * 48, 64)))
    before = len(driver.log)
    out = device.compile("rms_norm_gate_up_silu", eps=1e-6)(x, g, w)
    prologue, projection = driver.log[before:]
    assert prologue.function == "inverse_rms" and prologue.constants == {"eps": 1e-6}
    assert unpack_params(prologue) == (12, 64)
    assert projection.function == "linear_simdgroup"  # 12 tokens on an Apple9 GPU
    assert projection.constants == {
        "has_bias": False, "has_norm": True, "gated": True, "has_residual": False, "weight_type": 0
    }
    assert projection.buffers[3][0] is g.buffer and projection.buffers[4][0] is prologue.buffers[1][0]
    assert unpack_params(projection) == (12, 64, 48) and out.shape == (12, 48)


def test_the_default_projection_is_tiled_without_simdgroup_matrices(open_emulated, rng) -> None:
    emu = open_emulated(64, FakeMTLDevice("AMD Radeon Pro 5600M", MAC2, unified=False))
    assert "simdgroup" not in emu.device.kernels()["linear"]
    x, w = emu.device.upload(_f32(rng, 9, 32)), emu.device.upload(_f32(rng, 32, 32))
    emu.device.compile("linear_add")(x, w, x)
    assert emu.driver.log[-1].function == "linear_tiled"
    assert emu.driver.log[-1].buffers[5][0] is x.buffer


def test_pool_kernels_bind_the_layer_by_offset(open_emulated, rng) -> None:
    emu = open_emulated()
    device, driver = emu.device, emu.driver
    layout = PageLayout(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8)
    pool = device.allocate_pages(layout)
    layer_bytes = 5 * 2 * 4 * 2 * 8 * 4
    k = device.upload(_f32(rng, 2, 16))
    device.compile("append_kv", layer=2)(pool, k, k, device.upload(np.array([3, 9], np.int32)))
    assert driver.log[-1].buffers[0] == (pool.buffer, 2 * layer_bytes)
    assert unpack_params(driver.log[-1]) == (2, 16, 4, 5)
    batch = [np.array(v, np.int32) for v in ([0, 1, 3], [0, 1, 3], [2, 0, 4], [3, 1])]
    q = device.upload(_f32(rng, 3, 4 * 8))
    device.compile("attention", layer=1, num_heads=4, scale=0.5)(q, pool, *(device.upload(a) for a in batch))
    call = driver.log[-1]
    assert call.function == "attention_prefill" and call.constants == {"scale": 0.5, "window": 0, "softcap": 0.0}
    assert call.buffers[1] == (pool.buffer, layer_bytes)
    assert unpack_params(call) == (3, 2, 4, 2, 8, 4, 5)


def test_shape_errors_are_clear(open_emulated, rng) -> None:
    device = open_emulated().device
    x, w = device.upload(_f32(rng, 3, 64)), device.upload(_f32(rng, 32, 60))
    with pytest.raises(ValueError, match=r"linear: x \(3, 64\) has 64 columns, the weight \(32, 60\) takes 60"):
        device.compile("linear")(x, w, None)
    with pytest.raises(ValueError, match="expected a 1-d int32"):
        device.compile("embedding")(device.upload(np.zeros(3, np.int64)), x)
    pool = device.allocate_pages(PageLayout(1, 4, 4, 2, 8))
    ints = device.upload(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"q \(1, 24\) is not \[tokens, 3 heads \* 8\] over 2 KV heads"):
        device.compile("attention", layer=0, num_heads=3, scale=1.0)(
            device.upload(_f32(rng, 1, 24)), pool, ints, ints, ints, ints
        )
    with pytest.raises(ValueError, match="has no layer 1"):
        device.compile("append_kv", layer=1)(pool, x, x, ints)
    with pytest.raises(ValueError, match=r"append_kv: k \(3, 64\), v \(3, 64\), slots \(2,\) are not \[tokens, 16\]"):
        device.compile("append_kv", layer=0)(pool, x, x, ints)
    positions, inv_freq = device.upload(np.zeros(3, np.int32)), device.upload(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"rope: inv_freq must be \[4\], got \(2,\)"):
        device.compile("rope", head_dim=8)(x, positions, inv_freq)
    with pytest.raises(ValueError, match=r"add: shapes \(3, 64\) and \(32, 60\) differ"):
        device.compile("add")(x, w)
    with pytest.raises(ValueError, match="silu_mul: width 5 is odd"):
        device.compile("silu_mul")(device.upload(_f32(rng, 2, 5)))


# -- pipelines ------------------------------------------------------------------


def test_pipelines_and_libraries_are_built_once_per_key(open_emulated) -> None:
    emu = open_emulated()
    engine, info, driver = emu.engine, emu.device.info, emu.driver
    request = KernelRequest("rms_norm", None, (("eps", 1e-5),))
    engine.pie_compile_kernel(info, request)
    built = driver.pipelines_built
    engine.pie_compile_kernel(info, request)  # a second launcher reuses the cached pipeline
    assert driver.pipelines_built == built
    engine.pie_compile_kernel(info, KernelRequest("rms_norm", None, (("eps", 1e-6),)))
    assert driver.pipelines_built == built + 1
    engine.pie_compile_kernel(info, KernelRequest("softmax", None, (("temperature", 0.5),)))
    engine.pie_compile_kernel(
        info, KernelRequest("attention", "msl", (("layer", 0), ("num_heads", 4), ("scale", 0.25)))
    )
    keys = emu.context.pipeline_keys
    assert ("rms_norm", (("eps", 1e-5),)) in keys and ("rms_norm", (("eps", 1e-6),)) in keys
    off = (("scale", 0.25), ("softcap", 0.0), ("window", 0))  # no window, no capping
    assert ("attention_decode", off) in keys and ("attention_prefill", off) in keys
    assert driver.libraries_compiled == 2  # rows.metal and attention.metal, each compiled once


def test_unknown_kernels_and_variants_are_refused(open_emulated) -> None:
    emu = open_emulated()
    # Unknown kernels and variants are the facade's to refuse (pie.plugins checks the listing first).
    with pytest.raises(EngineError, match=r"linear\[simdgroup-v2\]"):
        emu.device.compile("linear", "simdgroup-v2")
    with pytest.raises(EngineError, match="gelu"):
        emu.device.compile("gelu")


def test_kernel_source_shows_the_msl(open_emulated) -> None:
    device = open_emulated().device
    text = device.source(KernelRequest("rms_norm_linear", "tiled", (("eps", 1e-5),)))
    assert "kernel void linear_tiled(" in text and "kernel void inverse_rms(" in text
    assert text.startswith("// rms_norm_linear[tiled], compile-time options: eps=1e-05")


def test_attention_runs_the_decode_kernel_for_decode_passes(open_emulated, rng) -> None:
    emu = open_emulated()
    device, driver = emu.device, emu.driver
    pool = device.allocate_pages(PageLayout(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8))
    arrays = [np.array(v, np.int32) for v in ([0, 1, 2], [0, 3], [0, 1, 2], [2, 1])]  # one token each
    attention = device.compile("attention", layer=0, num_heads=2, scale=0.5)
    q = device.upload(_f32(rng, 2, 16))
    tables = [device.upload(a) for a in arrays]
    attention(q, pool, *tables)  # outside a pass: one token per sequence is a decode batch
    assert driver.log[-1].function == "attention_decode"
    prefill = PassPlan.from_batch(
        ids=np.zeros(2, np.int32), positions=np.array([0, 1], np.int32), slots=np.array([0, 1], np.int32),
        qo_indptr=np.array([0, 2], np.int32), kv_page_indices=np.array([0], np.int32),
        kv_page_indptr=np.array([0, 1], np.int32), kv_last_page_lens=np.array([2], np.int32),
        sample_rows=np.array([1], np.int32), page_size=4,
    )
    emu.engine.pie_begin_pass(device.info, prefill)
    attention(q, pool, *tables)  # the pass plan decides, not the shapes
    assert driver.log[-1].function == "attention_prefill"
    emu.engine.pie_end_pass(device.info)
    attention(q, pool, *tables)
    assert driver.log[-1].function == "attention_decode"


# -- command buffers ------------------------------------------------------------


def test_launches_are_batched_until_the_host_needs_a_result(open_emulated, rng) -> None:
    emu = open_emulated(dispatches_per_commit=2)
    device, driver = emu.device, emu.driver
    a = device.upload(_f32(rng, 4, 8))
    add = device.compile("add")
    outs = [add(a, a) for _ in range(5)]
    assert driver.executed == 0 and driver.commits == 2  # submitted in twos, nothing waited for
    np.testing.assert_allclose(device.download(outs[-1]), 2 * device.download(a))
    assert driver.executed == 5 and driver.commits == 3
    device.synchronize()  # nothing pending: no new command buffer
    assert driver.commits == 3


# -- buffer reuse ---------------------------------------------------------------


def test_a_dead_tensors_buffer_is_reused_by_the_next_kernel_output(open_emulated, rng) -> None:
    device = open_emulated().device
    a = device.upload(_f32(rng, 4, 8))
    add = device.compile("add")
    first = add(a, a)
    buffer = first.buffer
    del first
    assert add(a, a).buffer is buffer


def test_an_upload_never_overwrites_a_buffer_queued_work_still_reads(open_emulated, rng) -> None:
    emu = open_emulated()
    device, driver = emu.device, emu.driver
    host = _f32(rng, 4, 8)
    a = device.upload(host)
    add = device.compile("add")
    twice = add(a, a)
    freed = twice.buffer
    four = add(twice, twice)  # queued: reads `twice`
    del twice
    gc.collect()
    fresh = device.upload(np.full((4, 8), 100.0, F32))  # the host write waits for the queued work first
    assert driver.executed == 2 and fresh.buffer is freed
    np.testing.assert_allclose(device.download(four), 4 * host)
    np.testing.assert_allclose(device.download(fresh), 100.0)


def test_interleaved_uploads_and_kernels_stay_correct(open_emulated, rng) -> None:
    device = open_emulated(dispatches_per_commit=3).device
    add = device.compile("add")
    expected = _f32(rng, 5, 16)
    current = device.upload(expected)
    for step in range(30):
        other = _f32(rng, 5, 16)
        current = add(current, device.upload(other))
        expected = expected + other
        if step % 7 == 3:
            np.testing.assert_allclose(device.download(current), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(device.download(current), expected, rtol=1e-5, atol=1e-5)


def test_tensors_beyond_32_bit_indexing_are_refused(open_emulated) -> None:
    with pytest.raises(ValueError, match="2\\*\\*32 elements"):
        open_emulated().context.empty((2**16, 2**16 + 1))


# -- pages ----------------------------------------------------------------------


def test_page_reads_wait_for_queued_appends(open_emulated, rng) -> None:
    device = open_emulated().device
    layout = PageLayout(num_layers=2, num_pages=6, page_size=4, num_kv_heads=1, head_dim=8)
    pool = device.allocate_pages(layout)
    host = np.zeros(layout.shape, F32)
    k, v = _f32(rng, 3, 8), _f32(rng, 3, 8)
    slots = np.array([5, 6, 21], np.int32)
    device.compile("append_kv", layer=1)(pool, device.upload(k), device.upload(v), device.upload(slots))
    kernels.append_kv(host, k, v, slots, layer=1)
    np.testing.assert_array_equal(device.read_pages(pool, np.arange(6)), host)
    device.write_pages(pool, np.array([1]), np.ones((2, 1, 2, 4, 1, 8), F32))
    host[:, 1] = 1.0
    np.testing.assert_array_equal(device.read_pages(pool, np.arange(6)), host)
    device.free_pages(pool)
    with pytest.raises(ValueError, match=r"append_kv pool: expected a 6-d float32 tensor, got \(0,\)"):
        device.compile("append_kv", layer=0)(pool, device.upload(k), device.upload(v), device.upload(slots))


def test_page_pools_respect_the_gpus_largest_buffer(open_emulated) -> None:
    device = open_emulated(device=FakeMTLDevice(max_buffer=1 << 20)).device
    with pytest.raises(ValueError, match="largest buffer"):
        device.allocate_pages(PageLayout(num_layers=30, num_pages=100, page_size=16, num_kv_heads=3, head_dim=64))
    with pytest.raises(ValueError, match="float32"):
        device.allocate_pages(PageLayout(1, 4, 4, 1, 8, dtype="float16"))
