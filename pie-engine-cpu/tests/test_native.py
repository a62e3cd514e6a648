"""The native kernels: built once per machine, equal to the numpy kernels, safe across threads and forks,
and simply not offered where no C compiler builds them."""

from __future__ import annotations

import multiprocessing
import os
import platform
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from pie.contract import KernelRequest, kv_host_dtype
from pie.enginekit.compile_cache import CompileCache
from pie.enginekit.host_compiler import HostBuildError
from pie.plugins import EngineError, EngineRegistry
from pie.testing.conformance import plan_of_batch
from pie_engine_cpu import kernels, native, plugin

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def _inputs(tokens: int, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, cols), dtype=np.float32)
    weight = rng.standard_normal((rows, cols), dtype=np.float32) * 0.1
    return x, weight, rng.standard_normal(rows, dtype=np.float32), rng.standard_normal(cols, dtype=np.float32)


# 70 columns: not a multiple of the 16-float vectors; 96x1024: large enough to split across threads;
# 5x16384: split across threads into more chunks than rows, so some chunks are empty.
@pytest.mark.parametrize("tokens", [1, 2, 3, 6, 7, 8, 9, 13, 16, 17, 32, 33])
@pytest.mark.parametrize(("rows", "cols"), [(7, 70), (96, 1024), (130, 576), (5, 16384)])
def test_projections_equal_the_numpy_kernels(
    compiled: native.NativeKernels, tokens: int, rows: int, cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled, "max_rows", 64)  # the kernels take any rows; past max_rows BLAS is faster
    x, weight, bias, norm_weight = _inputs(tokens, rows, cols, seed=tokens * rows)
    residual = np.random.default_rng(1).standard_normal((tokens, rows), dtype=np.float32)
    _assert_same_projection(native.make_linear(_refuse)(x, weight, bias), kernels.linear(x, weight, bias))
    _assert_same_projection(
        native.make_linear_add(_refuse)(x, weight, residual), kernels.linear_add(x, weight, residual)
    )
    _assert_same_projection(
        native.make_rms_norm_linear(_refuse, 1e-5)(x, norm_weight, weight, bias),
        kernels.make_rms_norm_linear(1e-5)(x, norm_weight, weight, bias),
    )
    gate_up = np.concatenate([weight, weight[::-1] * 3])
    _assert_same_projection(
        native.make_rms_norm_gate_up_silu(_refuse, 1e-5)(x, norm_weight, gate_up),
        kernels.make_rms_norm_gate_up_silu(1e-5)(x, norm_weight, gate_up),
    )


def test_projections_of_more_tokens_than_one_tile_equal_the_numpy_kernels(compiled: native.NativeKernels) -> None:
    # A projection sweeps its tokens in tiles of half the L2 cache: at 16384 columns a tile holds 6 to 30
    # tokens for any L2 of up to 4 MiB, so 45 tokens take several tiles and a part-filled last one.
    x, weight, bias, _ = _inputs(45, 64, 16384, seed=45)
    _assert_same_projection(native.make_linear(_refuse)(x, weight, bias), kernels.linear(x, weight, bias))


def _assert_same_projection(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal within float32 rounding of two summation orders, relative to the largest output: over
    16384-long rows the gated outputs reach tens, and both kernels land about 1e-3 from the float64
    result on some of them (an element-wise 1e-4 then measures the reference's rounding, not the kernel)."""
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(expected).max())))


def _refuse(*args: object) -> None:
    raise AssertionError("the native kernel handed these rows to BLAS")


def test_more_rows_than_a_native_projection_takes_go_to_blas(compiled: native.NativeKernels) -> None:
    calls = []

    def blas(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        calls.append(x.shape[0])
        return kernels.linear(x, weight, bias)

    linear = native.make_linear(blas)
    for tokens in (compiled.max_rows, compiled.max_rows + 1):
        x, weight, bias, _ = _inputs(tokens, 16, 32)
        np.testing.assert_allclose(linear(x, weight, bias), kernels.linear(x, weight, bias), **TOLERANCE)
    assert calls == [compiled.max_rows + 1]


def test_column_major_activations_are_read_correctly(compiled: native.NativeKernels) -> None:
    """The BLAS kernels leave column-major results; a native kernel after one must read them right."""
    x, weight, _, norm_weight = _inputs(5, 64, 96)
    column_major = np.asfortranarray(x)
    np.testing.assert_allclose(native.make_linear(_refuse)(column_major, weight), x @ weight.T, **TOLERANCE)
    rope = native.make_rope(16)
    positions = np.arange(40, 45, dtype=np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    qkv = kernels.project(x, np.random.default_rng(2).standard_normal((96, 96), dtype=np.float32))
    assert not qkv.flags.c_contiguous
    expected = kernels.make_rope(16)(np.ascontiguousarray(qkv[:, 32:64]), positions, inv_freq)
    np.testing.assert_allclose(rope(qkv[:, 32:64], positions, inv_freq), expected, **TOLERANCE)


def test_append_kv_writes_strided_rows_into_their_slots(compiled: native.NativeKernels) -> None:
    rng = np.random.default_rng(4)
    pool = np.zeros((2, 6, 2, 4, 2, 8), dtype=np.float32)
    qkv = kernels.project(rng.standard_normal((5, 16), dtype=np.float32), rng.standard_normal((48, 16), dtype=np.float32))
    k, v = qkv[:, 16:32], qkv[:, 32:48]
    slots = np.array([3, 4, 5, 20, 21], dtype=np.int32)
    expected = pool.copy()
    kernels.make_append_kv(1)(expected, k, v, slots)
    native.make_append_kv(1)(pool, k, v, slots)
    np.testing.assert_array_equal(pool, expected)


NARROW_KV = ["float16", "bfloat16"]


@pytest.mark.parametrize("kv_dtype", NARROW_KV)
def test_append_kv_rounds_to_nearest_even_in_a_narrow_pool(compiled: native.NativeKernels, kv_dtype: str) -> None:
    """Ties, subnormals of both types, values past float16's range, infinities and NaN: as numpy rounds them."""
    host = kv_host_dtype(kv_dtype)
    special = np.array(
        [1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**-25, 3 * 2.0**-25, 2.0**-24 * 1.5,
         6e-5, 65504, 65519, 65520, 1e6, -1e-8, np.inf, -np.inf, np.nan, 1e-40, -3e38],
        dtype=np.float32,
    )
    rng = np.random.default_rng(5)
    k = np.concatenate([special, rng.standard_normal(46, dtype=np.float32) * 10.0 ** rng.integers(-6, 5, 46)])
    k = k.astype(np.float32).reshape(4, 16)
    v = -k[::-1].copy()
    slots = np.array([3, 4, 5, 20], dtype=np.int32)
    pool = np.zeros((2, 6, 2, 4, 2, 8), dtype=host)
    native.make_append_kv(1)(pool, k, v, slots)
    expected = np.zeros(pool.shape, dtype=host)
    with np.errstate(over="ignore"):  # numpy warns of the values it rounds to infinity
        kernels.make_append_kv(1)(expected, k, v, slots)
        rounded = k[0].astype(host)
    np.testing.assert_array_equal(pool.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(expected[1, 0, 0, 3].ravel().view(np.uint16), rounded.view(np.uint16))


@pytest.mark.parametrize("kv_dtype", NARROW_KV)
@pytest.mark.parametrize(
    ("lengths", "new"),
    [([37, 5, 64, 200], [1, 1, 1, 1]), ([150], [1]), ([30, 8], [3, 1]), ([300, 9, 30], [300, 1, 5])],
    ids=["decode-batch", "key-ranges", "prefill-after-a-prefix", "prefill-and-decode"],
)
@pytest.mark.parametrize("head_dim", [24, 64, 88])
@pytest.mark.parametrize("page_size", [4, 32])
def test_attention_over_a_narrow_pool_equals_the_numpy_kernel_over_its_widened_values(
    compiled: native.NativeKernels, kv_dtype: str, lengths: list[int], new: list[int], head_dim: int, page_size: int
) -> None:
    q, pool, *batch = _paged_batch(lengths, new, seed=sum(lengths), head_dim=head_dim, page_size=page_size)
    narrow = pool.astype(kv_host_dtype(kv_dtype))
    expected = kernels.make_attention(1, 6, 0.25)(q, narrow.astype(np.float32), *batch)
    np.testing.assert_allclose(native.make_attention(1, 6, 0.25)(q, narrow, *batch), expected, **TOLERANCE)
    np.testing.assert_allclose(kernels.make_attention(1, 6, 0.25)(q, narrow, *batch), expected, **TOLERANCE)


def _paged_batch(
    lengths: list[int], new: list[int], seed: int, head_dim: int = 16, page_size: int = 4, kv_heads: int = 2
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    num_heads = 6
    pool = rng.standard_normal((2, 96, 2, page_size, kv_heads, head_dim), dtype=np.float32)
    free = list(rng.permutation(96))
    indices, indptr, last = [], [0], []
    for length in lengths:
        pages = -(-length // page_size)
        indices += [free.pop() for _ in range(pages)]
        indptr.append(len(indices))
        last.append(length - (pages - 1) * page_size)
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((int(qo[-1]), num_heads * head_dim), dtype=np.float32)
    return q, pool, qo, np.array(indices, np.int32), np.array(indptr, np.int32), np.array(last, np.int32)


@pytest.mark.parametrize(
    ("lengths", "new"),
    [
        ([1], [1]),
        ([37, 5, 64, 200], [1, 1, 1, 1]),
        ([9, 12], [0, 1]),
        ([30, 8], [3, 1]),
        ([300, 9], [300, 4]),
        ([300, 9, 30], [300, 1, 5]),
    ],
    ids=["first-token", "decode-batch", "idle-sequence", "prefill-after-a-prefix", "prefills", "prefill-and-decode"],
)
# 88 = 64 + 16 + 8 features: blocks of 4, 1 and no vectors; 64: prefill rows in tiles on every build
@pytest.mark.parametrize("head_dim", [16, 24, 64, 88])
@pytest.mark.parametrize("page_size", [4, 32])  # 32: keys scored a vector's width (16, 8 or 4) at a time
def test_attention_equals_the_numpy_kernel(
    compiled: native.NativeKernels, lengths: list[int], new: list[int], head_dim: int, page_size: int
) -> None:
    q, pool, *batch = _paged_batch(lengths, new, seed=sum(lengths), head_dim=head_dim, page_size=page_size)
    expected = kernels.make_attention(1, 6, 0.25)(q, pool, *batch)
    np.testing.assert_allclose(native.make_attention(1, 6, 0.25)(q, pool, *batch), expected, **TOLERANCE)


def test_more_query_rows_than_the_native_rows_are_attended_by_numpy(
    compiled: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def counted(*args: object) -> int:
        calls.append(args[8])  # the sequence count
        return compiled_kernel(*args)

    compiled_kernel = compiled.paged_attention
    monkeypatch.setattr(compiled, "paged_attention", counted)
    monkeypatch.setattr(compiled, "max_rows", 8)  # both read as the launcher is made
    attention = native.make_attention(1, 6, 0.25)
    for lengths, new in (([20, 9], [7, 1]), ([20, 9], [8, 1])):
        q, pool, *batch = _paged_batch(lengths, new, seed=3)
        expected = kernels.make_attention(1, 6, 0.25)(q, pool, *batch)
        np.testing.assert_allclose(attention(q, pool, *batch), expected, **TOLERANCE)
    assert calls == [2], "8 rows natively, 9 by numpy"


def test_a_pass_reads_its_positions_and_attention_indices_from_its_plan(
    compiled: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within a pass, RoPE launches share the rotary tables of the plan's positions, made once per table of
    frequencies, and native attention reads the plan's index arrays; after it, launches read their arguments."""
    q, pool, *batch = _paged_batch([30, 8], [3, 1], seed=2)
    plan = plan_of_batch(dict(zip(ATTENTION_INDICES, batch, strict=True)), page_size=4)
    x = np.random.default_rng(0).standard_normal((plan.num_tokens, 32), dtype=np.float32)
    frequencies = [1.0 / base ** (np.arange(0, 16, 2, dtype=np.float32) / 16) for base in (1e4, 1e6)]
    expected_rope = [kernels.make_rope(16)(x, plan.positions, inv_freq) for inv_freq in frequencies]
    expected_attention = kernels.make_attention(1, 6, 0.25)(q, pool, *batch)
    built: list[np.ndarray] = []
    build = kernels.RopeTables.build
    monkeypatch.setattr(kernels.RopeTables, "build", staticmethod(lambda p, f: built.append(f) or build(p, f)))
    indices_read = []

    def spied(*args: object) -> int:
        indices_read.append(args[3:7])
        return attend(*args)

    attend = compiled.paged_attention
    monkeypatch.setattr(compiled, "paged_attention", spied)  # read as the launcher is made
    ropes, attention = (native.make_rope(16), kernels.make_rope(16)), native.make_attention(1, 6, 0.25)
    kernels.begin_pass(plan)
    try:
        for rope, n in ((r, n) for r in ropes for n in (0, 1, 0, 1)):
            np.testing.assert_allclose(rope(x, plan.positions, frequencies[n]), expected_rope[n], **TOLERANCE)
        uploaded = [indices.copy() for indices in batch]  # as a device holds them: not the plan's arrays
        np.testing.assert_allclose(attention(q, pool, *uploaded), expected_attention, **TOLERANCE)
    finally:
        kernels.end_pass()
    assert [id(f) for f in built] == [id(f) for f in frequencies], "one set of tables per table of frequencies"
    assert indices_read == [tuple(getattr(plan, name).ctypes.data for name in ATTENTION_INDICES)], "the plan's arrays"
    later = plan.positions + 5
    rotated_later = ropes[0](x, later, frequencies[0])
    assert len(built) == 3, "outside a pass a launch makes the tables of its own positions"
    assert not np.allclose(rotated_later, expected_rope[0])
    np.testing.assert_allclose(rotated_later, kernels.make_rope(16)(x, later, frequencies[0]), **TOLERANCE)


ATTENTION_INDICES = ("qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")


def test_more_query_rows_than_kv_tokens_is_named(compiled: native.NativeKernels) -> None:
    q, pool, qo, indices, indptr, last = _paged_batch([3], [3], seed=1)
    with pytest.raises(ValueError, match="attention: a sequence brings more new tokens than its pages hold"):
        native.make_attention(1, 6, 0.25)(np.concatenate([q, q]), pool, np.array([0, 6], np.int32), indices, indptr, last)


def test_a_layer_the_page_pool_lacks_is_refused_before_a_launch_writes_past_it() -> None:
    """append_kv and attention take their layer when compiled, and the native ones address it unbounded:
    layer 1 of a one-layer pool was the memory behind it. Here that memory is watched: nothing reaches it."""
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    block = np.zeros((2, 8, 2, 4, 2, 16), np.float32)
    pool = block[:1]  # a one-layer pool with memory behind it to write into
    k, slots = np.ones((3, 32), np.float32), np.arange(3, dtype=np.int32)
    tables = [np.array(values, np.int32) for values in ([0, 3], [0], [0, 1], [3])]
    refused = r"the page pool \(1, 8, 2, 4, 2, 16\) has no layer 1"
    assert "native" in device.kernels()["append_kv"] and "native" in device.kernels()["attention"]
    for variant in device.kernels()["append_kv"]:
        with pytest.raises(ValueError, match=f"append_kv: {refused}"):
            device.compile("append_kv", variant, layer=1)(pool, k, k, slots)
    for variant in device.kernels()["attention"]:
        with pytest.raises(ValueError, match=f"attention: {refused}"):
            device.compile("attention", variant, layer=1, num_heads=2, scale=0.25)(k, pool, *tables)
    assert not block.any()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"slots": [0, 1, 32]}, "append_kv: slot 32 is outside the pool's 8 pages of 4 tokens"),
        ({"slots": [0, -5, 2]}, "append_kv: slot -5 is outside the pool's 8 pages of 4 tokens"),
        ({"pages": [0, 8]}, "attention: kv_page_indices holds page 8, outside the pool's 8 pages"),
        ({"pages": [-1, 3]}, "attention: kv_page_indices holds page -1, outside the pool's 8 pages"),
        ({"indptr": [0, 3]}, "attention: kv_page_indptr ends at 3, for 2 page indices"),
        ({"qo": [0, 2]}, "attention: qo_indptr ends at 2, for 3 query rows"),
        ({"last": [0]}, r"attention: kv_last_page_lens must be in 1\.\.4"),
    ],
    ids=["slot-past-the-pool", "negative-slot", "page-past-the-pool", "negative-page", "indptr-past-the-indices",
         "rows-not-the-query", "empty-last-page"],
)
def test_page_tables_and_slots_outside_the_pool_are_refused_before_any_page_is_touched(
    damage: dict[str, list[int]], message: str
) -> None:
    """A damaged page table or slot (a page id past the pool, a negative one) was followed unbounded by the
    native kernels and wrapped around by numpy's indexing. Every variant refuses it, naming the value, and
    neither the pool nor the memory around it changes."""
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    block = np.zeros((3, 8, 2, 4, 2, 16), np.float32)
    pool = block[1:2]  # a one-layer pool with watched memory before and after it
    k = np.ones((3, 32), np.float32)
    slots = np.array(damage.get("slots", [0, 1, 2]), np.int32)
    tables = [np.array(damage.get(name, default), np.int32)
              for name, default in (("qo", [0, 3]), ("pages", [0, 1]), ("indptr", [0, 2]), ("last", [3]))]
    kernel = "append_kv" if "slots" in damage else "attention"
    options = {"layer": 0} if kernel == "append_kv" else {"layer": 0, "num_heads": 2, "scale": 0.25}
    arguments = (pool, k, k, slots) if kernel == "append_kv" else (k, pool, *tables)
    assert "native" in device.kernels()[kernel]
    for variant in device.kernels()[kernel]:
        with pytest.raises(ValueError, match=message):
            device.compile(kernel, variant, **options)(*arguments)
    assert not block.any()


@pytest.mark.parametrize(
    ("lengths", "new", "kv_heads"),
    [([150], [1], 2), ([1, 300], [1, 1], 1), ([9, 300], [0, 1], 1), ([70], [1], 3), ([5], [1], 2)],
    ids=["one-sequence", "a-page-and-many", "idle-and-long", "three-kv-heads", "fewer-pages-than-ranges"],
)
def test_few_items_attend_in_key_ranges_that_combine_exactly(
    compiled: native.NativeKernels, lengths: list[int], new: list[int], kv_heads: int
) -> None:
    """Fewer (sequence, KV head) items than two per thread: each is cut into ranges of whole pages, attended
    apart and combined by their peaks; a sequence with fewer pages than ranges leaves some ranges empty."""
    q, pool, *batch = _paged_batch(lengths, new, seed=sum(lengths), head_dim=24, page_size=8, kv_heads=kv_heads)
    expected = kernels.make_attention(1, 6, 0.25)(q, pool, *batch)
    np.testing.assert_allclose(native.make_attention(1, 6, 0.25)(q, pool, *batch), expected, **TOLERANCE)


def test_callers_on_many_threads_get_their_own_results(compiled: native.NativeKernels) -> None:
    """ctypes releases the GIL: tasks arrive from several threads at once and must not mix."""
    linear = native.make_linear(_refuse)
    problems = [_inputs(2, 256, 512, seed) for seed in range(8)]
    results: dict[int, list[np.ndarray]] = {i: [] for i in range(len(problems))}

    def work(index: int) -> None:
        x, weight, bias, _ = problems[index]
        for _ in range(40):
            results[index].append(linear(x, weight, bias))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, (x, weight, bias, _) in enumerate(problems):
        for got in results[index]:
            np.testing.assert_allclose(got, kernels.linear(x, weight, bias), **TOLERANCE)


def _linear_in_child(queue: multiprocessing.Queue) -> None:
    x, weight, bias, _ = _inputs(3, 256, 512, seed=9)
    queue.put(float(np.abs(native.make_linear(kernels.linear)(x, weight, bias) - kernels.linear(x, weight, bias)).max()))


def test_a_forked_child_runs_the_kernels_without_the_parents_threads(compiled: native.NativeKernels) -> None:
    native.make_linear(kernels.linear)(*_inputs(1, 256, 512)[:2])  # the parent's workers exist and have run
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_linear_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child hung or crashed (waiting on workers it does not have?)"
    assert queue.get(timeout=5) < 1e-4


def test_the_build_is_keyed_on_this_cpu(tmp_path: Path, compiled: native.NativeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """``-march=native`` makes another CPU's build wrong here: its flags are in the key."""
    source = "int pie_answer(void) { return 42; }\n"
    here = native.build_library(source, cache=CompileCache("cpu", tmp_path))
    assert native.build_library(source, cache=CompileCache("cpu", tmp_path)) == here
    monkeypatch.setattr(native, "cpu_identity", lambda: "x86_64 sse2")
    assert native.build_library(source, cache=CompileCache("cpu", tmp_path)) != here


def test_a_build_that_fails_is_tried_once_and_its_reason_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel compile asks whether the native kernels exist: a compiler that rejects native.c must not
    run again for each of them."""
    attempts = []

    def rejected(source: str, cc: str | None = None, cache: CompileCache | None = None) -> Path:
        attempts.append(source)
        raise HostBuildError("cc rejected native.c")

    monkeypatch.setattr(native, "build_library", rejected)
    native._built.cache_clear()
    try:
        assert [native.available() for _ in range(5)] == [False] * 5
        with pytest.raises(HostBuildError, match="rejected native.c"):
            native.load()
        assert len(attempts) == 1
    finally:
        native._built.cache_clear()


@pytest.mark.parametrize(
    ("reason", "fix"),
    [
        ("no C compiler found (looked for $CC, cc, gcc, clang)", "install a C compiler"),
        ("native.c cannot be built: [Errno 28] No space left on device", "free some disk space"),
    ],
)
def test_without_the_native_kernels_the_engine_says_why_and_the_fix_for_that_cause(
    monkeypatch: pytest.MonkeyPatch, reason: str, fix: str
) -> None:
    """A profile measured with them then says the native kernels are unavailable, not that it is wrong; and
    `pie doctor` advises installing a compiler only where none was found."""

    def fails(source: str, cc: str | None = None, cache: CompileCache | None = None) -> Path:
        raise HostBuildError(reason, fix)

    monkeypatch.setattr(native, "build_library", fails)
    native._built.cache_clear()
    try:
        device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
        assert device.unavailable_variants() == {"native": f"native kernels are unavailable: {reason}"}
        assert "native" not in device.kernels()["linear"]
        (finding,) = [d for d in plugin.pie_diagnose() if d.what == "native kernels"]
        assert not finding.ok and reason in finding.detail and finding.fix == fix
    finally:
        native._built.cache_clear()


def test_a_kernel_cache_that_cannot_be_written_still_gives_the_native_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """PIE_CPU_CACHE_DIR a file (or HOME read-only, or a full disk) turned them off: decode ran through numpy.
    Then every process built them again (11 s each): now they are kept in the user's own temporary folder."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PIE_CPU_CACHE_DIR", str(blocker))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # for the engine's probe, in a process of its own
    native._built.cache_clear()
    try:
        library = native.load()
        fallback = tmp_path / "tmp" / f"pie-cpu-kernels-{os.getuid()}"
        assert library.cache_problem.startswith(str(blocker)) and library.cache_fallback == fallback
        assert library.path.is_relative_to(fallback)
        device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
        assert device.kernels()["linear"][0] == "native" and device.unavailable_variants() == {}
        found = {d.what: d for d in plugin.pie_diagnose()}
        assert found["native kernels"].ok
        assert not found["kernel cache"].ok and "PIE_CPU_CACHE_DIR" in found["kernel cache"].fix
        assert f"kept in {fallback}" in found["kernel cache"].detail
        assert "compiler" not in found["kernel cache"].fix
    finally:
        native._built.cache_clear()


def test_pie_engines_names_c_among_the_kernel_languages_where_the_native_kernels_build() -> None:
    """`pie engines` listed the CPU engine's kernels as numpy only, while its native C kernels ran the model."""
    if not native.available():
        pytest.skip(f"the native kernels do not build here: {native.unavailable_reason()}")
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    assert any("native" in variants for variants in device.kernels().values())
    assert "c" in device.engine.info.kernel_languages


def test_without_the_native_kernels_the_engine_offers_numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    listed = device.kernels()
    assert all("native" not in variants for variants in listed.values())
    assert listed["attention"] == ("numpy",) and listed["rms_norm_linear"][0] == "numpy"
    with pytest.raises(EngineError, match="native"):
        device.compile("rope", "native", head_dim=16)
    launcher = plugin.pie_compile_kernel(device.info, KernelRequest("linear"))
    assert launcher.__wrapped__ is kernels.linear  # behind the kit's argument check
    from test_regions import _region

    assert plugin.pie_compile_region(device.info, _region(bias=False)) is None
    assert plugin.pie_compile_kernel(device.info, KernelRequest("rope", None, (("head_dim", 16),))) is not None


def test_the_engine_measures_its_read_bandwidth_with_the_native_kernels(compiled: native.NativeKernels) -> None:
    from pie.bench import measure_bandwidth

    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    # Rates only have to be plausible (a loaded machine reads slowly); read_bandwidth itself checks that the
    # pass summed every element it was given.
    native_read = device.memory_bandwidth()
    assert native_read is not None and 0 < native_read < 1e13
    assert 0 < measure_bandwidth(device, megabytes=64, repeats=2) < 1e13
    # `pie bench` reads once after every decode step: the probe's buffer is made once, not per call.
    made = native._read_buffer.cache_info().misses
    assert 0 < native.read_bandwidth(megabytes=64, passes=1) < 1e13
    assert 0 < native.read_bandwidth(megabytes=64, passes=1) < 1e13
    assert native._read_buffer.cache_info().misses <= made + 1
    with pytest.raises(ValueError, match="at least one pass"):
        native.read_bandwidth(megabytes=64, passes=0)


def test_x86_builds_take_up_to_2048_rows_and_arm_16(compiled: native.NativeKernels) -> None:
    """Measured in the engine, the x86 builds beat OpenBLAS up to 2048 rows; ARM keeps 16, unmeasured."""
    assert compiled.max_rows == (2048 if platform.machine() in ("x86_64", "AMD64") else 16)
