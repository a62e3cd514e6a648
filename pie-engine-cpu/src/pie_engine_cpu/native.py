"""Native kernels for decode sizes, compiled on this machine by its C compiler.

At decode sizes a projection streams its weight from memory once per step, and the projections of
``native.c`` (one sequential stream per core) read it faster than OpenBLAS's GEMV does
(``benchmarks/native_kernels.py``). RoPE, ``append_kv``, paged attention, the attention-input region and
whole decoder layers of a decode pass (``layers.py``) are native too. The library is compiled once per
source, compiler and CPU with ``-O3 -march=native`` into the engine's checksummed compile cache
(``pie.enginekit``) and loaded with ctypes. Without a C compiler the ``native`` variant is not offered:
``pie doctor`` says why and how to get one.
"""

from __future__ import annotations

import _ctypes
import ctypes
import os
import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from pie.contract import KV_DTYPES
from pie.enginekit.compile_cache import CompileCache, cache_dir_env
from pie.enginekit.host import cpu_identity, usable_cpus
from pie.enginekit.host_compiler import HostBuildError, build_shared_library
from pie.kernels import attention_options
from pie.plugins import EngineSettingError
from pie.runtime.pass_plan import check_page_table_values, check_slot_values
from pie.weights import StoredWeight

from pie_engine_cpu import kernels

F32 = np.float32
KV_TYPES = {name: code for code, name in enumerate(KV_DTYPES)}
"""A page pool's element type -> its code in ``native.c`` (``KV_F32``, ``KV_F16``, ``KV_BF16``)."""
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11", "-pthread")
ENGINE = "cpu"
"""The compile cache's name: ``PIE_CPU_CACHE_DIR`` names its folder, ``PIE_CPU_CACHE=0`` builds every time."""


def build_library(source: str, cc: str | None = None, cache: CompileCache | None = None, fresh: bool = False) -> Path:
    """``source`` compiled with ``FLAGS`` into the engine's compile cache, or the library already built for it
    (`pie.enginekit.host_compiler`; not with ``fresh``); the CPU's flags are in the key, so another CPU
    (``-march=native``) never reuses a build."""
    return build_shared_library(source, "native.c", FLAGS, cpu_identity(), cache or CompileCache(ENGINE), cc, ("-lm",),
                                fresh)


_P = ctypes.c_void_p
_L = ctypes.c_long
_F = ctypes.c_float
_I = ctypes.c_int

TYPE_CODES = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14, "bf16": 30,
}
"""The native kernels' code of each weight type they read (GGML's numbering, ``W_*`` in native.c)."""
WEIGHT_TYPES = ("f16", "bf16", "q8_0", "q6_k", "q5_k", "q5_0", "q4_1", "q4_k", "q4_0")
"""The stored types the native projections and embedding read directly (``pie_weight_types``)."""
ACTIVATIONS = {"float": 0, "int8": 1, "int16": 2}
DEFAULT_ACTIVATIONS = "int16"
"""How a projection on a block-quantized weight treats its activations (native.c says how each works). int8
activations (llama.cpp's way) answer the default model's default question wrongly; int16 ones answer it as
float ones do, and decode faster (``benchmarks/README.md``)."""
INTEGER_MAX_TOKENS = 4
"""The most tokens a pass on a block-quantized weight takes the integer GEMV for; longer passes take float
activations, where one dequantized weight row serves every token, or, with int16 activations on an AVX-512
VNNI build, the integer panels (``has_panels``)."""


def activations() -> str:
    """``$PIE_CPU_ACTIVATIONS`` (``float``, ``int16`` or ``int8``), else the default: read when the library loads,
    and checked by the device probe wherever the library builds or not."""
    value = os.environ.get("PIE_CPU_ACTIVATIONS", DEFAULT_ACTIVATIONS)
    if value not in ACTIVATIONS:  # the user's: an error, not a reason for numpy (or another engine) unannounced
        raise EngineSettingError(f"PIE_CPU_ACTIVATIONS is {value!r}; expected one of {', '.join(ACTIVATIONS)}")
    return value


ENTRY_POINTS: dict[str, tuple[tuple[type, ...], type | None]] = {
    "set_threads": ((_I,), _I),
    "linear": ((_P, _I, _P, _P, _P, _P, _L, _L, _L), _I),
    "rms_norm_linear": ((_P, _P, _F, _P, _I, _P, _P, _L, _L, _L), _I),
    "rms_norm_gate_up_silu": ((_P, _P, _F, _P, _I, _P, _L, _L, _L), _I),
    "dequantize_rows": ((_P, _I, _P, _L, _L, _P), None),
    "quant_config": ((_I, _I, _L), _I),
    "has_panels": ((), _I),
    "rope": ((_P, _L, _L, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L), None),
    "append_kv": ((_P, _I, _P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _L), _I),
    "paged_attention": ((_P, _P, _I, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _F, _L, _F, _L, _L, _L), _I),
    "rms_norm_qkv_rope": ((_P, _P, _F, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L), _I),
    "decoder_layers": ((_P, _L, _P, _P, _P), _I),
    "stream_read": ((_P, _L), _F),
    "max_rows": ((), _I),
}
"""Each ``pie_<name>`` function of ``native.c``: its argument types and its result type (the native ABI)."""


class NativeKernels:
    """The compiled library's entry points (``ENTRY_POINTS``), with their C signatures bound once: each is
    the attribute of its name, but for the three asked once here (``set_threads``, ``has_panels``, ``max_rows``)."""

    def __init__(self, path: Path, threads: int):
        """OSError where the library cannot be loaded, AttributeError where it lacks an entry point."""
        library = ctypes.CDLL(str(path))
        try:
            functions = {name: getattr(library, f"pie_{name}") for name in ENTRY_POINTS}
        except AttributeError:
            _ctypes.dlclose(library._handle)  # else loading a library built again at this path would give this one
            raise
        self.path = path
        self.cache_problem = ""
        """Why the compile cache could not be written when the library was built ("" when it could): the
        library then lives in ``cache_fallback``, or, where there is none, in a temporary folder, and every
        process builds it again."""
        self.cache_fallback: Path | None = None
        """The user's own temporary folder the compile cache turned to (:class:`CompileCache`'s ``fallback``)."""
        for name, (argtypes, restype) in ENTRY_POINTS.items():
            functions[name].argtypes, functions[name].restype = argtypes, restype
        self.threads: int = functions.pop("set_threads")(threads)
        self.has_panels = bool(functions.pop("has_panels")())
        """Whether batches on block-quantized and K-quant weights with int16 activations run as integer panels, 16
        tokens to a vector (``native.c`` says how): AVX-512 VNNI builds."""
        self.max_rows: int = functions.pop("max_rows")()
        """Token rows a native projection or attention takes; more go to BLAS / numpy: 2048 on x86-64,
        16 on ARM (``MAX_ROWS`` in ``native.c`` says why). ``pie tune`` finds any crossover below this."""
        for name, function in functions.items():
            setattr(self, name, function)
        self.quant_config(ACTIVATIONS[activations()], 0, INTEGER_MAX_TOKENS)


@cache
def _built() -> NativeKernels | HostBuildError:
    """The loaded kernels, or why they cannot be: a failed build is remembered too, since ``@cache`` keeps
    no exception and every kernel compile asks (it would run the compiler again each time)."""
    source = resources.files("pie_engine_cpu").joinpath("native.c").read_text()
    cache = CompileCache(ENGINE)
    try:
        built = _load_built(source, cache)
    except HostBuildError as error:
        return error
    built.cache_problem, built.cache_fallback = cache.problem, cache.fallback
    return built


def _load_built(source: str, cache: CompileCache) -> NativeKernels:
    """The library built from ``source``, loaded. One from the compile cache that does not load, or lacks an entry
    point, is built again once: its checksums vouch for its bytes, not for what they are."""
    path = build_library(source, cache=cache)
    try:
        return NativeKernels(path, usable_cpus())
    except (OSError, AttributeError) as error:
        if not cache.stats.hits:  # built just now: building it again would give the same
            raise _unloadable(path, error) from error
        cache.log.warning("the native kernels in %s cannot be loaded (%s); building them again", path, error)
    path = build_library(source, cache=cache, fresh=True)
    try:
        return NativeKernels(path, usable_cpus())
    except (OSError, AttributeError) as error:
        raise _unloadable(path, error) from error


def _unloadable(path: Path, error: Exception) -> HostBuildError:
    """Why the library built at ``path`` cannot be used; the fix where its folder is mounted noexec."""
    return HostBuildError(f"the native kernels in {path} cannot be loaded: {error}",
                          f"if {path.parent} is on a file system mounted noexec, name another folder in "
                          f"{cache_dir_env(ENGINE)}")


def load() -> NativeKernels:
    """Build (once per machine) and load the native kernels; HostBuildError says why not."""
    built = _built()
    if isinstance(built, HostBuildError):
        raise built
    return built


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be built or loaded here, in one line; None where they can."""
    built = _built()
    if isinstance(built, HostBuildError):
        return str(built).splitlines()[0]
    return None


def available() -> bool:
    try:
        load()
    except HostBuildError:
        return False
    return True


@cache
def _read_buffer(megabytes: int) -> np.ndarray:
    """The bandwidth probe's buffer, made once: ``pie bench`` reads it after every timed decode step,
    and making 768 MB (and warming its TLB entries) takes far longer than a pass."""
    from pie_engine_cpu.memory import huge_page_block

    values = huge_page_block(megabytes * 2**20).view(np.float32)
    values.fill(1.0)
    load().stream_read(values.ctypes.data, values.size)  # the first pass warms the TLB and the threads
    return values


def read_bandwidth(megabytes: int = 768, passes: int = 5) -> float:
    """Bytes/s of the best of ``passes`` parallel passes over a huge-page buffer far larger than the
    caches: what the native projections' weight streams could reach at most."""
    if passes < 1:
        raise ValueError(f"the bandwidth probe needs at least one pass, not {passes}")
    library, values = load(), _read_buffer(megabytes)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        total = library.stream_read(values.ctypes.data, values.size)
        best = min(best, time.perf_counter() - start)
    if abs(total - values.size) > 1e-3 * values.size:
        raise RuntimeError(f"the bandwidth pass read {total} instead of {values.size}: the native kernels are broken")
    return values.nbytes / best


def address(array: np.ndarray | None) -> int | None:
    """The address of an array's first element (None for None), cheaper than ``array.ctypes.data``."""
    if array is None:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]  # ndarray exports a buffer
    except (TypeError, ValueError, BufferError):  # read-only or not contiguous
        return array.ctypes.data


def weight_address(weight: np.ndarray | StoredWeight | None) -> tuple[int | None, int]:
    """A weight's address and native type code: a float32 array or a StoredWeight of a type the kernels read."""
    if weight is None:
        return None, 0
    if isinstance(weight, StoredWeight):
        code = TYPE_CODES.get(weight.type)
        if code is None or not weight.data.flags.c_contiguous:
            raise ValueError(f"native kernels take weights of types {', '.join(TYPE_CODES)}, not {weight!r}")
        return weight.data.ctypes.data, code
    if not (weight.flags.c_contiguous and weight.dtype == F32):
        raise ValueError(f"native kernels take C-contiguous float32 weights, not {weight.dtype} {weight.strides}")
    return address(weight), 0


class Pinned:
    """The address of a launcher's weight, read once: a plan passes the same weight object every step.
    ``type`` is the weight's native type code (see ``weight_address``)."""

    __slots__ = ("array", "pointer", "type")

    def __init__(self) -> None:
        self.array: np.ndarray | StoredWeight | None = None
        self.pointer: int | None = None
        self.type = 0

    def __call__(self, array: np.ndarray | StoredWeight | None) -> int | None:
        if array is not self.array:
            self.pointer, self.type = weight_address(array)
            self.array = array
        return self.pointer


def float32_rows(x: np.ndarray) -> np.ndarray:
    """x as C-contiguous float32 rows (a no-op for the engine's own decode activations)."""
    return np.ascontiguousarray(x, dtype=F32)


OUTSIDE_POOL = -4
"""A native launch refused page tables or slots that do not fit the page pool; the launcher names the value."""


def checked(status: int) -> None:
    if status == OUTSIDE_POOL:
        raise ValueError("the page tables or slots do not fit the page pool")
    if status != 0:
        raise MemoryError("native kernel could not allocate its scratch rows")


def _bounded(blas: Callable[..., np.ndarray], native_call: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """``native_call`` on x as float32 rows for up to ``max_rows`` token rows, ``blas`` on more."""
    max_rows = load().max_rows

    def projection(x: np.ndarray, *args: Any) -> np.ndarray:
        return blas(x, *args) if x.shape[0] > max_rows else native_call(float32_rows(x), *args)

    return projection


def make_linear(blas: Callable[..., np.ndarray], adds_residual: bool = False) -> Callable[..., np.ndarray]:
    """``linear`` (the third argument a bias), or with ``adds_residual`` ``linear_add`` (a residual)."""
    kernel, weight_at, bias_at = load().linear, Pinned(), Pinned()

    def linear(x: np.ndarray, weight: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        out = np.empty((x.shape[0], weight.shape[0]), dtype=F32)
        residual = float32_rows(extra) if adds_residual else None
        bias = None if adds_residual else bias_at(extra)
        rows = (x.shape[0], *weight.shape)
        checked(kernel(weight_at(weight), weight_at.type, address(x), bias, address(residual), address(out), *rows))
        return out

    return _bounded(blas, linear)


def make_linear_add(blas: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    return make_linear(blas, adds_residual=True)


def make_rms_norm_linear(blas: Callable[..., np.ndarray], eps: float) -> Callable[..., np.ndarray]:
    kernel, norm_at, weight_at, bias_at = load().rms_norm_linear, Pinned(), Pinned(), Pinned()

    def rms_norm_linear(x: np.ndarray, norm: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        out = np.empty((x.shape[0], weight.shape[0]), dtype=F32)
        norm_pointer, weight_pointer = norm_at(norm), weight_at(weight)
        checked(
            kernel(address(x), norm_pointer, eps, weight_pointer, weight_at.type, bias_at(bias), address(out),
                   x.shape[0], *weight.shape)
        )
        return out

    return _bounded(blas, rms_norm_linear)


def make_rms_norm_gate_up_silu(blas: Callable[..., np.ndarray], eps: float) -> Callable[..., np.ndarray]:
    kernel, norm_at, weight_at = load().rms_norm_gate_up_silu, Pinned(), Pinned()

    def rms_norm_gate_up_silu(x: np.ndarray, norm: np.ndarray, gate_up: np.ndarray) -> np.ndarray:
        inter = gate_up.shape[0] // 2
        out = np.empty((x.shape[0], inter), dtype=F32)
        norm_pointer, weight_pointer = norm_at(norm), weight_at(gate_up)
        checked(
            kernel(address(x), norm_pointer, eps, weight_pointer, weight_at.type, address(out),
                   x.shape[0], inter, gate_up.shape[1])
        )
        return out

    return _bounded(blas, rms_norm_gate_up_silu)


def dequantized(weight: StoredWeight, first: int = 0, stop: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``first:stop`` of a stored weight as float32 (into ``out`` when given): by the native kernels where
    they build (the BLAS paths on stored weights pay this every call, and the ``gguf`` library's numpy
    dequantization takes many times as long), else by ``StoredWeight.dequantize``. The two give the same values."""
    rows, cols = weight.shape
    stop = rows if stop is None else stop
    if out is None:
        out = np.empty((stop - first, cols), dtype=F32)
    try:
        kernel = load().dequantize_rows
    except HostBuildError:
        kernel = None
    if kernel is None or weight.type not in TYPE_CODES:
        out[...] = weight.rows(slice(first, stop)).dequantize()
        return out
    pointer, code = weight_address(weight)
    ids = np.arange(first, stop, dtype=np.int32)  # held: the kernel reads it after address() returns
    kernel(pointer, code, address(ids), stop - first, cols, address(out))
    return out


def make_embedding(numpy_embedding: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """Rows of an embedding table; a stored table's rows are dequantized natively (float32 ones by numpy)."""
    kernel = load().dequantize_rows

    def embedding(ids: np.ndarray, table: np.ndarray | StoredWeight) -> np.ndarray:
        if not isinstance(table, StoredWeight):
            return numpy_embedding(ids, table)
        pointer, code = weight_address(table)
        ids = int32_indices(ids)
        if len(ids) and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise IndexError(f"token ids must lie in [0, {table.shape[0]})")
        out = np.empty((len(ids), table.shape[1]), dtype=F32)
        kernel(pointer, code, address(ids), len(ids), table.shape[1], address(out))
        return out

    return embedding


def _element_strides(x: np.ndarray) -> tuple[int, int]:
    if x.dtype != F32:
        raise ValueError(f"native kernels take float32, not {x.dtype}")
    return x.strides[0] // 4, x.strides[1] // 4


def int32_indices(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.int32)


class LayerAddress:
    """The address of one layer's pages in a pool ``[layers, pages, ...]`` and their element type
    (``KV_TYPES``), read once per pool."""

    __slots__ = ("kv_type", "layer", "pool", "pointer")

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.pool: np.ndarray | None = None
        self.pointer = 0
        self.kv_type = 0

    def __call__(self, pool: np.ndarray) -> int:
        if pool is not self.pool:
            kv_type = KV_TYPES.get(pool.dtype.name)
            if not pool.flags.c_contiguous or kv_type is None:
                raise ValueError(f"native kernels take a C-contiguous page pool of {', '.join(map(str, KV_TYPES))}")
            self.pool, self.pointer = pool, pool.ctypes.data + self.layer * pool.strides[0]
            self.kv_type = kv_type
        return self.pointer


def make_rope(head_dim: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    kernel = load().rope
    table_addresses: list[Any] = [None, 0, 0, 0, 0]

    def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        tables = kernels.rope_tables(positions, inv_freq)
        if tables is not table_addresses[0]:
            table_addresses[:] = [
                tables,
                *(address(t) for t in (tables.cos_by_token, tables.sin_by_token, tables.cos_by_feature, tables.sin_by_feature)),
            ]
        x_strides = _element_strides(x)
        # The result keeps x's layout: a column-major projection stays column-major, read and written in order.
        out = np.empty(x.shape, dtype=F32) if x_strides[1] == 1 else np.empty(x.shape[::-1], dtype=F32).T
        kernel(
            address(x), *x_strides, *table_addresses[1:], out.ctypes.data, *_element_strides(out),
            x.shape[0], x.shape[1] // head_dim, head_dim,
        )
        return out

    return rope


def make_append_kv(layer: int) -> Callable[..., None]:
    kernel, layer_at = load().append_kv, LayerAddress(layer)

    def append_kv(pool: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        slots = int32_indices(slots)  # held: the kernel reads it after address() returns
        page_size, num_pages = pool.shape[3], pool.shape[1]
        status = kernel(
            layer_at(pool), layer_at.kv_type, address(k), *_element_strides(k), address(v), *_element_strides(v),
            address(slots), k.shape[0], k.shape[1], page_size, num_pages,
        )
        if status == OUTSIDE_POOL:
            check_slot_values("append_kv", slots, page_size, num_pages)
        checked(status)

    return append_kv


def make_attention(
    layer: int, num_heads: int, scale: float, window: int = 0, softcap: float = 0.0
) -> Callable[..., np.ndarray]:
    """Causal attention over the paged cache, decode and prefill rows alike (``pie_paged_attention``), up
    to ``max_rows`` query rows; more by the numpy kernel, whose BLAS blocks win the longest prefills
    (``benchmarks/README.md``)."""
    kernel, max_rows, layer_at = load().paged_attention, load().max_rows, LayerAddress(layer)
    blocks = kernels.make_attention(layer, num_heads, scale, window, softcap)
    window, softcap = attention_options(window, softcap)

    def attention(
        q: np.ndarray,
        pool: np.ndarray,
        qo_indptr: np.ndarray,
        kv_page_indices: np.ndarray,
        kv_page_indptr: np.ndarray,
        kv_last_page_lens: np.ndarray,
    ) -> np.ndarray:
        if q.shape[0] > max_rows:
            return blocks(q, pool, qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)
        _, _, _, page_size, kv_heads, head_dim = pool.shape
        q = float32_rows(q)
        out = np.empty(q.shape, dtype=F32)
        running = kernels.running_pass()
        if running is None:  # a launch of its own: its index arrays, held for the call
            held = [int32_indices(array) for array in (qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)]
            indices = tuple(map(address, held))
        else:
            held, indices = running.index_arrays[2:], running.index_addresses[2:]
        status = kernel(
            address(q), layer_at(pool), layer_at.kv_type, *indices, address(out),
            len(held[0]) - 1, num_heads, kv_heads, head_dim, page_size, scale, window, softcap,
            q.shape[0], len(held[1]), pool.shape[1],
        )
        if status == OUTSIDE_POOL:
            check_page_table_values("attention", *held, page_size, rows=q.shape[0], num_pages=pool.shape[1])
        checked(status)
        return out

    return attention
