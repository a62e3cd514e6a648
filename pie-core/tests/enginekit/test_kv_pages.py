"""KV pages in float32, float16 and bfloat16 on the shared-kernel engines (Vulkan and wgpu, here on lavapipe,
and wgpu's browser device, where Chromium's Tint and Dawn run the WGSL): rounding on write, attention on the
widened values, host copies in the pool's type, and a model's greedy text."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
from pie import kernels
from pie.contract import PageLayout
from pie.plugins import Device, EngineRegistry
from pie.testing.conformance import TOLERANCE, new_token_slots, random_batch

ENGINES = ("vulkan", "wgpu", "wgpu-browser")
KV_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NARROW = ("float16", "bfloat16")


@pytest.fixture(scope="module")
def registry() -> EngineRegistry:
    return EngineRegistry()


@pytest.fixture(scope="module", params=ENGINES)
def device(request: pytest.FixtureRequest, registry: EngineRegistry) -> Iterator[Device]:
    name, _, where = request.param.partition("-")
    pytest.importorskip(f"pie_engine_{name}")
    if not where:
        yield registry.engine(name).open(0)
        return
    from pie_engine_wgpu.browser import BrowserUnavailable, find_browser
    from pie_engine_wgpu.plugin import WgpuEngine

    try:
        find_browser()
    except BrowserUnavailable as exc:
        pytest.skip(f"no browser for the browser device: {exc}")
    engine = WgpuEngine(device="browser")
    browser_registry = EngineRegistry()
    browser_registry.register("wgpu", engine, "pie-engine-wgpu")
    device = browser_registry.engine("wgpu").open(0)
    yield device
    engine.close(device.info)


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint16 if array.dtype.itemsize == 2 else np.uint32)


def _edge_values(dtype: str, rng: np.random.Generator, count: int) -> np.ndarray:
    """float32 values that test rounding: exact midpoints between neighbours of ``dtype`` (ties to even), a
    float32 step either side of them, values across the whole exponent range, subnormals, overflow, infinities."""
    narrow = np.dtype(KV_DTYPES[dtype])
    finite = rng.integers(0, 0x7BFF if dtype == "float16" else 0x7F7F, count, dtype=np.uint16)
    low = finite.view(narrow).astype(np.float64)
    high = (finite + 1).view(narrow).astype(np.float64)
    midpoints = ((low + high) / 2).astype(np.float32)  # exact: one bit more than the narrow type holds
    step = np.nextafter(midpoints, np.float32(np.inf))
    below = np.nextafter(midpoints, np.float32(0))
    spread = (rng.standard_normal(count) * np.exp2(rng.uniform(-30, 20, count))).astype(np.float32)
    limit = float(ml_dtypes.finfo(narrow).max)
    largest = float(np.finfo(np.float32).max)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, limit, -limit, limit * 1.001, largest, 65520.0, 2.0**-25, 2.0**-24 * 1.5],
        np.float32,
    )
    values = np.concatenate([midpoints, step, below, spread, special])
    signs = np.where(rng.random(values.size) < 0.5, -1, 1).astype(np.float32)
    values[:-len(special)] *= signs[:-len(special)]
    return values


def test_both_engines_keep_kv_pages_in_the_three_types(device: Device) -> None:
    plugin = importlib.import_module(f"pie_engine_{device.name}.plugin").engine
    assert tuple(plugin.pie_kv_dtypes(device.info)) == ("float32", "float16", "bfloat16")


@pytest.mark.parametrize("dtype", NARROW)
def test_append_kv_rounds_to_nearest_even_as_numpy_does(device: Device, dtype: str) -> None:
    rng = np.random.default_rng(11)
    layout = PageLayout(num_layers=1, num_pages=40, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    width = layout.num_kv_heads * layout.head_dim
    values = _edge_values(dtype, rng, 600)
    tokens = -(-values.size // width)
    k = np.resize(values, tokens * width).reshape(tokens, width)
    v = -k[::-1].copy()
    slots = rng.permutation(layout.num_pages * layout.page_size)[:tokens].astype(np.int32)
    pool = device.allocate_pages(layout)
    try:
        device.compile("append_kv", layer=0)(pool, device.upload(k), device.upload(v), device.upload(slots))
        got = np.asarray(device.read_pages(pool, np.arange(layout.num_pages, dtype=np.int32)))
    finally:
        device.free_pages(pool)
    expected = np.zeros(layout.shape, KV_DTYPES[dtype])
    with np.errstate(over="ignore"):
        kernels.append_kv(expected, k, v, slots, layer=0)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(_bits(got), _bits(expected), err_msg=f"append_kv's {dtype} rounding")


def test_nan_stays_nan(device: Device) -> None:
    layout = PageLayout(num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=2, dtype="float16")
    pool = device.allocate_pages(layout)
    try:
        k = np.array([[np.nan, -np.nan]], np.float32)
        slots = device.upload(np.zeros(1, np.int32))
        device.compile("append_kv", layer=0)(pool, device.upload(k), device.upload(k), slots)
        got = np.asarray(device.read_pages(pool, np.zeros(1, np.int32)))
    finally:
        device.free_pages(pool)
    assert np.isnan(got.astype(np.float32)).all()


@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize("head_dim", [16, 6], ids=["dim16", "dim6"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_attention_reads_the_rounded_pages_widened(device: Device, dtype: str, head_dim: int, decode: bool) -> None:
    """Both variants (serial takes head_dim % 4 == 0, else group) against float32 attention over the pages
    rounded to ``dtype``; ragged sequences over several pages, 4 query heads on 2 KV heads."""
    rng = np.random.default_rng(head_dim + decode)
    page_size, num_heads, layer = 4, 4, 1
    layout = PageLayout(num_layers=2, num_pages=24, page_size=page_size, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    narrow = KV_DTYPES[dtype]
    host = rng.standard_normal(layout.shape).astype(np.float32).astype(narrow)
    batch = random_batch(rng, page_size, layout.num_pages, max_seqs=4 if decode else 3, decode=decode)
    tokens = int(batch["qo_indptr"][-1])
    width = layout.num_kv_heads * head_dim
    k = rng.standard_normal((tokens, width)).astype(np.float32)
    v = rng.standard_normal((tokens, width)).astype(np.float32)
    q = rng.standard_normal((tokens, num_heads * head_dim)).astype(np.float32)
    slots = new_token_slots(batch, page_size)
    pool = device.allocate_pages(layout)
    try:
        device.write_pages(pool, np.arange(layout.num_pages, dtype=np.int32), host)
        device.compile("append_kv", layer=layer)(pool, device.upload(k), device.upload(v), device.upload(slots))
        kernels.append_kv(host, k, v, slots, layer=layer)
        got_pages = np.asarray(device.read_pages(pool, np.arange(layout.num_pages, dtype=np.int32)))
        np.testing.assert_array_equal(_bits(got_pages), _bits(host), err_msg="the pool after append_kv")
        widened = host.astype(np.float32)
        expected = kernels.attention(q, widened, **batch, layer=layer, num_heads=num_heads, scale=0.25)
        names = ("qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")
        tables = [device.upload(batch[name]) for name in names]
        for variant in ("group", "serial"):
            attend = device.compile("attention", variant, layer=layer, num_heads=num_heads, scale=0.25)
            got = device.download(attend(device.upload(q), pool, *tables))
            np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"attention[{variant}] on {dtype} pages")
    finally:
        device.free_pages(pool)


@pytest.mark.parametrize("dtype", NARROW)
def test_pages_round_trip_and_copy_in_the_pool_type(device: Device, dtype: str) -> None:
    layout = PageLayout(num_layers=3, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    narrow = np.dtype(KV_DTYPES[dtype])
    pool = device.allocate_pages(layout)
    try:
        every = np.arange(layout.num_pages, dtype=np.int32)
        zeros = np.asarray(device.read_pages(pool, every))
        assert zeros.dtype == narrow and zeros.shape == layout.shape and not _bits(zeros).any()
        data = np.random.default_rng(3).standard_normal(layout.shape).astype(np.float32).astype(narrow)
        device.write_pages(pool, every, data)
        some = np.array([6, 1, 3], dtype=np.int32)
        np.testing.assert_array_equal(_bits(np.asarray(device.read_pages(pool, some))), _bits(data[:, some]))
        sources, destinations = np.array([5, 1], dtype=np.int32), np.array([2, 7], dtype=np.int32)
        device.copy_pages(pool, sources, destinations)
        expected = data.copy()
        expected[:, destinations] = data[:, sources]
        np.testing.assert_array_equal(_bits(np.asarray(device.read_pages(pool, every))), _bits(expected))
    finally:
        device.free_pages(pool)


def test_what_a_pool_cannot_hold_is_refused_by_name(device: Device) -> None:
    odd = PageLayout(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=7, dtype="float16")
    with pytest.raises(ValueError, match="head_dim 7 is odd"):
        device.allocate_pages(odd)
    with pytest.raises(ValueError, match="not float8"):
        device.allocate_pages(PageLayout(1, 2, 4, 1, 8, dtype="float8"))
    layout = PageLayout(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    pool = device.allocate_pages(layout)
    try:
        with pytest.raises(ValueError, match="holds bfloat16, the pages given are float32"):
            device.write_pages(pool, np.arange(2, dtype=np.int32), np.zeros(layout.shape, np.float32))
    finally:
        device.free_pages(pool)
