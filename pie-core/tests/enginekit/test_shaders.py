"""The shared Slang kernels: shipped files, manifest, launch plumbing (no GPU needed)."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pie import kernels
from pie.contract import KernelRequest
from pie.enginekit.host import may_have_hardware_gpu
from pie.enginekit.shaders import GENERATED_DIR, SOURCE_DIR, Entry, compiler_version, manifest, spirv, wgsl
from pie.enginekit.shaders.build import differences, entry_points
from pie.enginekit.shaders.launch import VARIANTS, Launchers, entry_names
from pie.enginekit.tensor import BufferPool, GpuTensor
from pie.enginekit.transfers import page_regions

needs_slang = pytest.mark.skipif(
    importlib.util.find_spec("slangpy") is None,
    reason="slangpy (the Slang compiler, a dev dependency) is not installed",
)


@needs_slang
def test_shipped_files_are_byte_identical_to_a_fresh_build(tmp_path: Path) -> None:
    from pie.enginekit.shaders.build import build
    from pie.enginekit.shaders.slang import SlangCompiler

    with SlangCompiler() as compiler:
        version = f"slang {compiler.version()}"
        assert version == compiler_version(), (
            f"the shipped shaders were built with {compiler_version()}, this is {version}: "
            "install the slangpy that carries it (see pie.enginekit.shaders.build) or rebuild them"
        )
        written = build(tmp_path, compiler)
    assert len(written) == 2 * len(manifest()) + 1
    changed = differences(GENERATED_DIR, tmp_path)
    assert not changed, f"out of date (run python -m pie.enginekit.shaders.build): {changed}"


@needs_slang
def test_compile_errors_name_the_entry_point(tmp_path: Path) -> None:
    from pie.enginekit.shaders.slang import SlangCompiler, SlangError

    source = tmp_path / "broken.slang"
    source.write_text('[shader("compute")]\n[numthreads(1, 1, 1)]\nvoid broken() { undefined_name = 1; }\n')
    with SlangCompiler() as compiler, pytest.raises(SlangError, match="broken.slang:broken"):
        compiler.compile(source, "broken", "wgsl")


def test_manifest_covers_every_entry_point_with_both_targets() -> None:
    names = [name for _, name, _ in entry_points(SOURCE_DIR)]
    assert sorted(names) == sorted(manifest())
    for name, entry in manifest().items():
        assert spirv(name)[:4] == b"\x03\x02\x23\x07", f"{name}.spv is not SPIR-V"
        assert f"fn {name}(" in wgsl(name)
        assert entry.bindings[0] == (0, "uniform"), f"{name}: binding 0 must be the uniform block"
        assert entry.params_size % 16 == 0 and entry.params_size >= 4 * len(entry.params)


def test_every_gpu_kernel_is_in_the_catalogue_with_shipped_entry_points() -> None:
    assert set(VARIANTS) | {"epilogue"} == set(kernels.CATALOG), "the GPU engines implement the whole catalogue"
    assert "epilogue" in Launchers(RecordingBackend(), epilogues=True).variants(), "eta epilogues where WGSL compiles"
    assert "epilogue" not in Launchers(RecordingBackend()).variants()
    for kernel, variants in VARIANTS.items():
        assert len(set(variants)) == len(variants)
        for name in entry_names(kernel):
            assert name in manifest(), f"{kernel}: entry point {name} is not shipped"


def test_uniform_block_packs_fields_by_name_in_order() -> None:
    entry = Entry(
        "demo", "demo.slang", (64, 1, 1), ((0, "uniform"),), (("count", "u32"), ("eps", "f32"), ("base", "i32"))
    )
    packed = entry.pack({"eps": 0.5, "count": 7, "base": -2})
    assert len(packed) == entry.params_size == 16
    assert np.frombuffer(packed[:4], np.uint32)[0] == 7
    assert np.frombuffer(packed[4:8], np.float32)[0] == 0.5
    assert np.frombuffer(packed[8:12], np.int32)[0] == -2
    with pytest.raises(KeyError, match="demo"):
        entry.pack({"count": 1})


def test_buffer_pool_recycles_by_capacity_and_bounds_what_it_keeps() -> None:
    created: list[int] = []
    destroyed: list[int] = []
    pool: BufferPool[int] = BufferPool(
        lambda size: created.append(size) or len(created), destroyed.append, keep_bytes=1024
    )
    first = GpuTensor(pool, (10, 3), np.dtype(np.float32))
    assert first.capacity == 256 and first.nbytes == 120
    buffer = first.buffer
    del first
    second = GpuTensor(pool, (64,), np.dtype(np.int32))
    assert second.buffer == buffer and len(created) == 1, "a dropped tensor's buffer is reused"
    big = [GpuTensor(pool, (200,), np.dtype(np.float32)) for _ in range(3)]
    assert pool.live_bytes == 256 + 3 * 1024
    del big
    assert pool.kept_bytes <= 1024 and len(destroyed) == 2
    second.free()
    assert pool.live_bytes == 0


def test_a_tensor_whose_buffer_could_not_be_made_leaves_nothing_to_give_back() -> None:
    """Its __del__ once met a tensor without a pool: 'Exception ignored in GpuTensor.__del__' on every failure."""

    def out_of_memory(size: int) -> int:
        raise RuntimeError("VkErrorOutOfDeviceMemory")

    pool: BufferPool[int] = BufferPool(out_of_memory, lambda buffer: None)
    unraisable: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(RuntimeError, match="VkErrorOutOfDeviceMemory"):
            GpuTensor(pool, (1 << 20,), np.dtype(np.float32))
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == [] and pool.live_bytes == 0


def test_buffer_pool_size_classes_never_keep_the_largest_and_retry_once_when_memory_runs_out() -> None:
    live: list[int] = []
    destroyed: list[int] = []

    def create(size: int) -> int:
        if sum(live) + size > 4096:
            raise MemoryError("device full")
        live.append(size)
        return len(live)

    def destroy(buffer: int) -> None:
        destroyed.append(buffer)
        live[buffer - 1] = 0

    pool: BufferPool[int] = BufferPool(create, destroy, capacity=lambda n: 1024 * -(-n // 1024), largest_kept=2048)
    small, capacity = pool.take(1000)
    assert capacity == 1024
    pool.give(small, capacity)
    assert pool.kept_bytes == 1024 and not destroyed
    large, capacity = pool.take(2048)
    pool.give(large, capacity)
    assert destroyed == [large] and pool.kept_bytes == 1024, "a buffer of largest_kept bytes is not kept"
    whole, capacity = pool.take(4096)  # only fits once the kept 1 KiB buffer is destroyed
    assert capacity == 4096 and destroyed == [large, small] and pool.kept_bytes == 0
    with pytest.raises(MemoryError, match="device full"):
        pool.take(1)


def test_buffers_a_backend_destroys_later_are_released_before_the_retry() -> None:
    """Vulkan destroys a buffer once the work recorded so far has run (at its next flush): the retry after the kept
    buffers were given up found their memory still held, and failed too."""
    live: list[int] = []
    retired: list[int] = []

    def create(size: int) -> int:
        if sum(live) + size > 4096:
            raise MemoryError("device full")
        live.append(size)
        return len(live)

    def release() -> None:  # the backend's flush
        for buffer in retired:
            live[buffer - 1] = 0
        retired.clear()

    pool: BufferPool[int] = BufferPool(create, retired.append, capacity=lambda n: 1024 * -(-n // 1024),
                                       release=release)
    kept, capacity = pool.take(1024)
    pool.give(kept, capacity)
    whole, capacity = pool.take(4096)  # fits once the kept buffer is destroyed and released
    assert capacity == 4096 and live == [0, 4096] and pool.kept_bytes == 0


def test_page_regions_are_layer_major_byte_ranges() -> None:
    shape = (2, 5, 2, 4, 1, 8)
    page = 2 * 4 * 8 * 4
    assert page_regions(shape, np.array([3, 1])) == [
        (3 * page, page),
        (1 * page, page),
        (8 * page, page),
        (6 * page, page),
    ]
    with pytest.raises(ValueError, match="page ids"):
        page_regions(shape, np.array([5]))


def test_every_variant_is_a_concrete_kernel() -> None:
    """No ``auto``: each listed variant launches entry points of its own; profiles choose among them."""
    assert VARIANTS["attention"] == ("serial", "group") and VARIANTS["linear"][0] == "rows_b4"
    for kernel, variants in VARIANTS.items():
        assert "auto" not in variants
        names = entry_names(kernel)
        assert all(name in manifest() for name in names)
        if variants != ("slang",):
            assert len(names) == len(variants), kernel


class RecordingBackend:
    """A backend that records dispatches instead of running them."""

    storage_alignment = 256
    max_binding_bytes = 1 << 27

    def __init__(self) -> None:
        self.pool: BufferPool[object] = BufferPool(lambda size: object(), lambda buffer: None)
        self.placeholder = (object(), 0, 256)
        self.dispatches: list[tuple[str, dict[str, Any], list[Any], tuple[int, int, int]]] = []

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> GpuTensor:
        return GpuTensor(self.pool, shape, dtype)

    def dispatch(self, entry: Entry, params: bytes, bindings: list[Any], groups: tuple[int, int, int]) -> None:
        values = dict(zip((name for name, _ in entry.params), np.frombuffer(params, np.uint32), strict=False))
        self.dispatches.append((entry.name, values, bindings, groups))


def test_linear_launch_picks_entry_grid_and_float4_views() -> None:
    backend = RecordingBackend()
    launch = Launchers(backend).compile(KernelRequest("linear", None))  # the default: rows_b4
    assert launch is not None
    x, w = backend.empty((3, 64), np.dtype(np.float32)), backend.empty((130, 64), np.dtype(np.float32))
    out = launch(x, w, None)
    assert out.shape == (3, 130)
    name, values, bindings, groups = backend.dispatches[-1]
    assert name == "linear__rows_b4" and groups == (3, 1, 1)
    assert values["tokens"] == 3 and values["outputs"] == 130 and values["inputs"] == 64 and values["has_bias"] == 0
    bound = dict(zip((index for index, _ in manifest()[name].storage_bindings), bindings, strict=True))
    assert sorted(bound) == [3, 6, 7, 8], "the rows family reads x and weight through float4 views"
    assert bound[3] is backend.placeholder, "a missing bias binds the placeholder"
    assert bound[7][0] is x.buffer and bound[8][0] is w.buffer and bound[6][0] is out.buffer
    odd_k = backend.empty((3, 62), np.dtype(np.float32))
    launch(odd_k, backend.empty((130, 62), np.dtype(np.float32)), None)
    assert backend.dispatches[-1][0] == "linear__gemv_b4", "K % 4 != 0 has no float4 view: gemv instead"
    half = backend.empty((130, 64), np.dtype(np.float16))  # a dense weight is read as float32: past its end
    with pytest.raises(ValueError, match=r"linear weight: expected a 2-d float32 tensor, got \(130, 64\) float16"):
        launch(x, half, None)


@pytest.mark.parametrize(("variant", "entry"), [("group", "attention__group"), (None, "attention__serial")])
def test_attention_binds_only_the_layer_it_reads(variant: str | None, entry: str) -> None:
    serial = variant is None  # serial, the default, suits software devices
    backend = RecordingBackend()
    options = (("layer", 1), ("num_heads", 4), ("scale", 0.5))
    launch = Launchers(backend).compile(KernelRequest("attention", variant, options))
    assert launch is not None
    pool = backend.empty((3, 5, 2, 3, 2, 8), np.dtype(np.float32))  # 1920-byte layers: layer 1 is not 256-aligned
    i32 = np.dtype(np.int32)
    tables = [backend.empty(shape, i32) for shape in ((2,), (2,), (2,), (1,))]
    q = backend.empty((6, 32), np.dtype(np.float32))
    launch(q, pool, *tables)
    name, values, bindings, groups = backend.dispatches[-1]
    assert name == entry
    assert groups == ((1, 6, 1) if serial else (4, 6, 1)), "serial: 8 heads per workgroup; group: one per head"
    bound = dict(zip((index for index, _ in manifest()[name].storage_bindings), bindings, strict=True))
    buffer, offset, size = bound[8 if serial else 2]
    assert buffer is pool.buffer and offset == 1792 and values["layer_base"] == (1920 - 1792) // 4
    assert size == 1920 + 128
    assert bound[9 if serial else 1][0] is q.buffer, "serial reads q through its float4 view"


@pytest.mark.parametrize(
    ("variant", "entry", "words"), [("group", "attention__group__f16", 10), ("serial", "attention__serial__bf16", 11)]
)
def test_a_16_bit_pool_binds_its_words_and_counts_elements(variant: str, entry: str, words: int) -> None:
    import ml_dtypes

    backend = RecordingBackend()
    dtype = np.dtype(np.float16 if entry.endswith("__f16") else ml_dtypes.bfloat16)
    pool = backend.empty((3, 5, 2, 3, 2, 8), dtype)  # 960-byte layers
    i32 = np.dtype(np.int32)
    tables = [backend.empty(shape, i32) for shape in ((2,), (2,), (2,), (1,))]
    options = (("layer", 1), ("num_heads", 4), ("scale", 0.5))
    attention = Launchers(backend).compile(KernelRequest("attention", variant, options))
    assert attention is not None
    attention(backend.empty((6, 32), np.dtype(np.float32)), pool, *tables)
    name, values, bindings, _ = backend.dispatches[-1]
    assert name == entry
    bound = dict(zip((index for index, _ in manifest()[name].storage_bindings), bindings, strict=True))
    assert bound[words][0] is pool.buffer and bound[words][1] == 768, "layer 1 starts at 960, aligned down to 256"
    assert values["layer_base"] == (960 - 768) // 2, "in elements of the pool, not bytes or words"
    append = Launchers(backend).compile(KernelRequest("append_kv", None, (("layer", 1),)))
    assert append is not None
    k = backend.empty((7, 16), np.dtype(np.float32))
    append(pool, k, k, backend.empty((7,), i32))
    name, values, bindings, groups = backend.dispatches[-1]
    assert name == "append_kv" + entry[entry.rindex("__") :] and groups == (1, 1, 1)
    assert values["layer_base"] == 96 and values["kv_width"] == 16
    with pytest.raises(ValueError, match="not int32"):
        append(backend.empty((3, 5, 2, 3, 2, 8), i32), k, k, backend.empty((7,), i32))


def test_epilogue_launch_uses_eta_bindings_and_grid() -> None:
    from pie.eta.stdlib import SOURCES

    backend = RecordingBackend()
    options = (("params", (("eps", 1e-5),)), ("source", SOURCES["rms_norm"]))
    launch = Launchers(backend, epilogues=True).compile(KernelRequest("epilogue", None, options))
    assert launch is not None
    x, weight = backend.empty((5, 40), np.dtype(np.float32)), backend.empty((40,), np.dtype(np.float32))
    out = launch(x, weight)
    assert out.shape == (5, 40)
    name, values, bindings, groups = backend.dispatches[-1]
    assert name.startswith("eta_") and groups == (5, 1, 1), "a row reduction runs one workgroup per row"
    assert [b[0] for b in bindings] == [x.buffer, weight.buffer, out.buffer]
    assert values["rows"] == 5 and values["cols"] == 40
    with pytest.raises(ValueError, match="weight"):
        launch(x, backend.empty((39,), np.dtype(np.float32)))


def test_a_row_beyond_the_binding_limit_is_a_clear_error() -> None:
    backend = RecordingBackend()
    backend.max_binding_bytes = 1024
    launch = Launchers(backend).compile(KernelRequest("rms_norm", None, (("eps", 1e-6),)))
    assert launch is not None
    big = backend.empty((3, 300), np.dtype(np.float32))  # 1,200 bytes a row: no launch binds one
    with pytest.raises(ValueError, match="largest storage binding"):
        launch(big, backend.empty((300,), np.dtype(np.float32)))


def test_rows_past_the_binding_limit_are_launched_in_turn_at_aligned_offsets() -> None:
    """x's rows are 80 bytes, so 16 rows keep an offset 256-aligned; 25 rows would fit 2,048 bytes."""
    backend = RecordingBackend()
    backend.max_binding_bytes = 2048
    launch = Launchers(backend).compile(KernelRequest("linear", None))
    assert launch is not None
    f32 = np.dtype(np.float32)
    x, weight = backend.empty((40, 20), f32), backend.empty((8, 20), f32)
    out = launch(x, weight, None)
    assert [values["tokens"] for _, values, _, _ in backend.dispatches] == [16, 16, 8]
    assert [groups for *_, groups in backend.dispatches] == [(1, 4, 1), (1, 4, 1), (1, 2, 1)], "rows_b4: 4 a group"
    name = backend.dispatches[0][0]
    slots = [index for index, _ in manifest()[name].storage_bindings]
    for first, (_, _, bindings, _) in zip((0, 16, 32), backend.dispatches, strict=True):
        bound = dict(zip(slots, bindings, strict=True))
        count = min(16, 40 - first)
        assert bound[6] == (out.buffer, first * 32, count * 32)
        assert bound[7] == (x.buffer, first * 80, count * 80), "x's float4 view"
        assert bound[8] == (weight.buffer, 0, weight.nbytes), "the weight is bound whole"


def test_priority_hint_sees_only_software_gpus_on_a_bare_linux_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from pie.enginekit import host

    monkeypatch.setattr(host.sys, "platform", "linux")
    monkeypatch.setattr(host.glob, "glob", lambda pattern: [])
    assert not may_have_hardware_gpu()
    monkeypatch.setattr(host.glob, "glob", lambda pattern: ["/dev/dri/renderD128"] if "dri" in pattern else [])
    assert may_have_hardware_gpu()
    monkeypatch.setattr(host.sys, "platform", "darwin")
    monkeypatch.setattr(host.glob, "glob", lambda pattern: [])
    assert may_have_hardware_gpu()
