"""Launchers of the catalogue kernels over the shipped Slang entry points, for any GPU engine.

An engine supplies a :class:`Backend` (allocate a tensor, record one dispatch);
everything else (which entry point a kernel and variant use, the uniform block,
the bindings, the grid) is decided here once, so the Vulkan and WebGPU engines
share not only the kernels but how they are launched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from pie.contract import KernelRequest, Launcher
from pie.enginekit.catalogue import (
    EpilogueProgram,
    attention_request,
    check_add,
    check_append_kv,
    check_attention,
    check_heads,
    check_indices,
    check_norm_weight,
    check_page_tables,
    check_projection,
    check_rope,
    check_rows,
    check_silu_mul,
    check_slice_columns,
    check_top_k,
    expect,
    embedding_launcher,
    pool_layer,
    projection_launcher,
)
from pie.enginekit.shaders import Entry, manifest
from pie.enginekit.tensor import GpuTensor, StoredTensor
from pie.kernels import PROJECTIONS
from pie.weights import row_bytes

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
MAX_GROUPS = 65535
"""Workgroups per grid dimension that every Vulkan and WebGPU device accepts."""
MAX_HEAD_DIM = 256
"""The largest head_dim the attention entry points take: they hold a row in 64 lanes of 4 dims, or 64 float4s
(``src/attention.slang``)."""
VECTOR_ALIGNMENT = 16
"""Byte alignment of a float4 view's binding (the serial attention's page rows)."""
LOOP_ITERATIONS = 65535
"""The loop iterations llvmpipe (lavapipe, Mesa's software device) lets one shader invocation make, all its loops
together: past them its loops end early, silently."""


def serial_attention_keys(head_dim: int) -> int:
    """The most keys of one sequence the serial attention computes right where loops are capped (see
    LOOP_ITERATIONS): it walks them in one invocation, a key taking two loops over its float4s (each counts its
    exit too) and the key loop's own step; its other loops (the query, the output, the sequence's search) take the
    rest. Past it the launcher runs the group variant, whose 64 invocations share a sequence's keys."""
    vectors = head_dim // 4
    return (LOOP_ITERATIONS - 2 * (vectors + 1) - 64) // (2 * vectors + 3)


def group_attention_keys(head_dim: int) -> int:
    """The most keys of a token the group attention takes in one launch where loops are capped (see
    LOOP_ITERATIONS); past them the launcher runs it over key ranges of this size in turn, the softmax state carried
    between launches. Its 64 invocations share a chunk of 64 keys, each one taking a loop over a key's head_dim (and
    its exit), two 6-step workgroup reductions with their exits, the 64 value rows with their exit and the chunk
    loop's step: head_dim + 81 iterations a chunk; the query, the sequence's search and the exits keep 64 more."""
    return 64 * ((LOOP_ITERATIONS - 64) // (head_dim + 81))


BufferRange = tuple[Any, int, int]
"""(engine buffer, byte offset, byte size) bound to one storage binding."""


class Backend(Protocol):
    """What an engine provides to run the shared kernels."""

    storage_alignment: int
    """Byte alignment of storage-buffer binding offsets (minStorageBufferOffsetAlignment)."""
    max_binding_bytes: int
    """Largest storage-buffer binding (maxStorageBufferRange)."""
    max_buffer_bytes: int
    """Largest buffer (maxMemoryAllocationSize, WebGPU's maxBufferSize)."""
    placeholder: BufferRange
    """A small buffer bound where an optional input (a missing bias) is absent."""

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> GpuTensor: ...

    def dispatch(
        self, entry: Entry, params: bytes, bindings: Sequence[BufferRange], groups: tuple[int, int, int]
    ) -> None:
        """Record one dispatch of ``entry``; ``bindings`` follow ``entry.storage_bindings``."""


LINEAR_VARIANTS = ("rows", "rows_b4", "rows_b8", "gemv", "gemv_b4", "gemv_b8", "tile16", "tile64")
_GROUP_SHAPE = {
    "rows": (64, 1),
    "rows_b4": (64, 4),
    "rows_b8": (64, 8),
    "gemv": (4, 1),
    "gemv_b4": (4, 4),
    "gemv_b8": (2, 8),
    "tile16": (16, 16),
    "tile64": (64, 64),
}
"""Output columns and token rows each workgroup of a variant computes."""
LINEAR_DEFAULT = "rows_b4"
"""The projections' default variant: four token rows a workgroup, no shared memory."""
_VECTOR_BINDINGS = {1: 7, 2: 8, 4: 9}
"""The rows family reads x, weight and norm_weight through float4 views at these bindings."""
_TOKEN_ROWS = (1, 5, 6, 7)
"""The linear kernels' bindings of a row a token: x, residual, the output and x's float4 view."""
_OUTPUT_ROWS = (5, 6)
"""The linear kernels' bindings of a row a token of the output's width: residual and the output."""
GATED = "rms_norm_gate_up_silu"
"""The projection whose weight stacks gate rows over up rows, the up row of a column ``outputs`` rows after its
gate row: no chunk of its rows holds both of a column, so a weight past one binding runs as ``rms_norm_linear`` over
every row (in chunks) then ``silu_mul`` of the two halves."""

SINGLE = "slang"
"""The variant name of kernels that have one implementation."""

VARIANTS: dict[str, tuple[str, ...]] = {
    "embedding": (SINGLE,),
    "rms_norm": (SINGLE,),
    "rms_norm_heads": (SINGLE,),
    "add": (SINGLE,),
    "slice_columns": (SINGLE,),
    "silu_mul": (SINGLE,),
    "rope": (SINGLE,),
    "append_kv": (SINGLE,),
    "attention": ("serial", "group"),
    "gather_rows": (SINGLE,),
    "argmax": (SINGLE,),
    "softmax": (SINGLE,),
    "top_k": (SINGLE,),
    **{name: (LINEAR_DEFAULT, *(v for v in LINEAR_VARIANTS if v != LINEAR_DEFAULT)) for name in PROJECTIONS},
}
"""Every catalogue kernel the GPU engines implement, with its variants (the default first). The defaults
suit software devices (serial attention, no shared memory); the engines' default profiles choose per
row count and device kind (``profiles/*-default*.toml`` of each engine)."""

_ENTRY_OF = {"embedding": "gather_rows"}

STORED_TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
"""The weight types (``pie.weights``) the kernels read as stored, dequantizing inside: the entry points
``{entry}__{type}`` beside each float32 one."""

_KV_ENTRY_SUFFIX = {"float32": "", "float16": "__f16", "bfloat16": "__bf16"}
"""append_kv and attention entry points by the pool's type: 16-bit pools are u32 words (``src/kv_words.slang``)."""

EPILOGUE_VARIANTS = ("eta",)
"""eta epilogues, rendered and compiled at run time: only for engines whose backend compiles shader
source when running (WGSL on WebGPU, Slang to SPIR-V on Vulkan when the Slang compiler is installed)."""


def entry_names(kernel: str) -> list[str]:
    """The entry points a kernel may launch (for listing sources)."""
    variants = list(VARIANTS[kernel])
    if variants == [SINGLE]:
        return [_ENTRY_OF.get(kernel, kernel)]
    return [f"{kernel}__{variant}" for variant in variants]


def max_pool_layer_bytes(backend: Backend) -> int:
    """The most bytes one layer of a page pool may take on ``backend``: ``append_kv`` and ``attention`` bind a
    layer as one range, which starts up to an offset alignment before the layer (:meth:`Launchers._layer`)."""
    return backend.max_binding_bytes - max(backend.storage_alignment, VECTOR_ALIGNMENT)


def _fold(groups: int) -> tuple[int, int, int]:
    """A 1-D count of workgroups folded into x and y."""
    groups_x = min(max(groups, 1), MAX_GROUPS)
    return groups_x, -(-groups // groups_x), 1


def _weight_bytes(weight: GpuTensor | StoredTensor) -> int:
    return weight.words.nbytes if isinstance(weight, StoredTensor) else weight.nbytes


def _weight_kind(weight: GpuTensor | StoredTensor) -> str:
    return weight.type if isinstance(weight, StoredTensor) else weight.dtype.name


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _pool_entry(entries: Mapping[str, Entry], pool: GpuTensor) -> Entry:
    """The entry point for a page pool of ``pool``'s type (``entries`` by numpy type name)."""
    entry = entries.get(pool.dtype.name)
    if entry is None:
        raise ValueError(f"page pools hold {', '.join(entries)}, not {pool.dtype.name}")
    _check(
        pool.dtype == F32 or pool.shape[-1] % 2 == 0,
        f"a {pool.dtype.name} page pool needs an even head_dim (two elements a word), not {pool.shape[-1]}",
    )
    return entry


class Launchers:
    """Builds the launcher of a :class:`KernelRequest` over one backend."""

    def __init__(self, backend: Backend, epilogues: bool = False, epilogue_target: str = "wgsl"):
        """``epilogues``: the backend compiles source of ``epilogue_target`` (an eta render target) at run
        time, in :attr:`Entry.code`, so eta epilogues run on it."""
        self.backend = backend
        self.epilogues = epilogues
        self.epilogue_target = epilogue_target
        self.entries = manifest()

    # -- plumbing ------------------------------------------------------------------

    def _bind(self, tensor: GpuTensor | StoredTensor | BufferRange | None) -> BufferRange:
        if tensor is None:
            return self.backend.placeholder
        if isinstance(tensor, StoredTensor):
            tensor = tensor.words
        if isinstance(tensor, GpuTensor):
            _check(
                tensor.nbytes <= self.backend.max_binding_bytes,
                f"a {tensor.shape} tensor ({tensor.nbytes} bytes) exceeds this device's largest storage binding "
                f"({self.backend.max_binding_bytes} bytes)",
            )
            return tensor.buffer, 0, max(4, tensor.nbytes)
        _check(
            tensor[2] <= self.backend.max_binding_bytes,
            f"a range of {tensor[2]} bytes exceeds this device's largest storage binding "
            f"({self.backend.max_binding_bytes} bytes)",
        )
        return tensor

    def _run(
        self,
        entry: Entry,
        values: Mapping[str, float],
        inputs: Mapping[int, GpuTensor | StoredTensor | BufferRange | None],
        groups: tuple[int, int, int],
    ) -> None:
        bindings = [self._bind(inputs[index]) for index, _ in entry.storage_bindings]
        self.backend.dispatch(entry, entry.pack(values), bindings, groups)

    def _elementwise(self, entry: Entry, count: int, values: Mapping[str, float], inputs: Mapping[int, Any]) -> None:
        if count == 0:
            return
        groups = _fold(-(-count // entry.workgroup[0]))
        self._run(entry, {**values, "groups_x": groups[0]}, inputs, groups)

    def _elementwise_rows(
        self, entry: Entry, rows_key: str, per_row: int, values: Mapping[str, float], inputs: Mapping[int, Any],
        slots: Sequence[int],
    ) -> None:
        """:meth:`_elementwise` over ``values[rows_key]`` rows of ``per_row`` invocations, in launches of
        :meth:`_row_launches`."""
        for count, bound in self._row_launches(int(values[rows_key]), inputs, slots):
            self._elementwise(entry, count * per_row, {**values, rows_key: count}, bound)

    def _row_launches(
        self, rows: int, inputs: Mapping[int, Any], slots: Sequence[int]
    ) -> Iterator[tuple[int, dict[int, Any]]]:
        """The launches of a kernel over ``rows`` rows of the row-major tensors at ``slots`` (a kernel reads and
        writes rows from its bindings' starts): ``(row count, inputs)`` each, none for no rows, one where every
        tensor fits a binding, else the rows in turn, bound at offsets. A vocabulary of 262,144 words takes 1 MiB of
        float32 logits a row, and a device binds 128 MiB (lavapipe, WebGPU's default): 129 rows were refused.
        Where not even the fewest rows fit, the one launch's :meth:`_bind` refuses the tensor."""
        if not rows:
            return
        tensors = {slot: inputs[slot] for slot in slots if isinstance(inputs.get(slot), GpuTensor)}
        row_bytes = {slot: tensor.nbytes // rows for slot, tensor in tensors.items()}
        chunk = self._rows_per_launch(list(row_bytes.values()))
        if not chunk or chunk >= rows:
            yield rows, dict(inputs)
            return
        for first in range(0, rows, chunk):
            count = min(chunk, rows - first)
            ranges = {slot: (tensor.buffer, first * row_bytes[slot], count * row_bytes[slot])
                      for slot, tensor in tensors.items()}
            yield count, {**inputs, **ranges}

    def _rows_per_launch(self, row_bytes: Sequence[int]) -> int:
        """The most rows (0: none) one launch binds of tensors of ``row_bytes`` a row each within the device's
        binding limit, in a multiple of the rows that keep every offset at the device's offset alignment and
        float4 views'."""
        row_bytes = [size for size in row_bytes if size]
        if not row_bytes:
            return 0
        alignment = max(self.backend.storage_alignment, VECTOR_ALIGNMENT)
        step = math.lcm(*(alignment // math.gcd(size, alignment) for size in row_bytes))
        most = min(self.backend.max_binding_bytes // size for size in row_bytes)
        return most // step * step

    def weight_rows_per_launch(self, weight_row_bytes: int, stored: bool) -> int:
        """The most rows (0: none) of a weight of ``weight_row_bytes`` a row one launch binds within the device's
        binding limit, where the weight does not fit one binding: a multiple of the rows that keep the offset of a
        chunk at the device's offset alignment and float4 views', and of a projection's output and residual at its
        first column (4 bytes a column). A weight in a stored type (``stored``) keeps its spare word after the
        chunk (``StoredTensor``)."""
        alignment = max(self.backend.storage_alignment, VECTOR_ALIGNMENT)
        step = math.lcm(*(alignment // math.gcd(size, alignment) for size in (weight_row_bytes, 4)))
        most = (self.backend.max_binding_bytes - (4 if stored else 0)) // weight_row_bytes
        return most // step * step

    def _weight_launches(
        self, kernel: str, weight: GpuTensor | StoredTensor
    ) -> Iterator[tuple[int, int, GpuTensor | StoredTensor | BufferRange]]:
        """(first row, row count, binding) of each launch over the rows of ``weight`` (a projection's output
        columns, an embedding table's words): the weight whole where it fits one binding, else chunks of
        :meth:`weight_rows_per_launch` rows bound at offsets (a stored chunk with the word after it)."""
        rows, columns = weight.shape
        if isinstance(weight, StoredTensor):
            buffer, size, stored = weight.words, row_bytes(weight.type, columns), True
        else:
            buffer, size, stored = weight, columns * weight.dtype.itemsize, False
        if buffer.nbytes <= self.backend.max_binding_bytes:
            yield 0, rows, weight
            return
        chunk = self.weight_rows_per_launch(size, stored)
        _check(
            chunk > 0,
            f"{kernel}: no launch binds aligned rows of a {rows}x{columns} {_weight_kind(weight)} weight "
            f"({size} bytes a row) within this device's largest storage binding ({self.backend.max_binding_bytes} "
            "bytes)",
        )
        for first in range(0, rows, chunk):
            count = min(chunk, rows - first)
            nbytes = count * size
            if stored:
                nbytes = -(-nbytes // 4) * 4 + 4
            yield first, count, (buffer.buffer, first * size, nbytes)

    def _layer(self, kernel: str, pool: GpuTensor, layer: int, alignment: int = 4) -> tuple[BufferRange, int]:
        """The pool binding for one layer and the element offset of the layer in it.

        The binding starts at the layer, aligned down to the device's offset alignment
        (and to ``alignment`` bytes, so float4 views stay aligned).
        """
        start, layer_bytes = pool_layer(kernel, pool, layer)
        aligned = start - start % max(self.backend.storage_alignment, alignment)
        size = start - aligned + layer_bytes
        _check(
            size <= self.backend.max_binding_bytes,
            f"one layer of the page pool ({size} bytes) exceeds the device's binding limit",
        )
        return (pool.buffer, aligned, size), (start - aligned) // pool.dtype.itemsize

    # -- kernels -------------------------------------------------------------------

    def variants(self) -> dict[str, tuple[str, ...]]:
        """Every kernel these launchers run, with its variants (the default first)."""
        return {**VARIANTS, "epilogue": EPILOGUE_VARIANTS} if self.epilogues else dict(VARIANTS)

    def compile(self, request: KernelRequest) -> Launcher:
        """The launcher of ``request``, whose kernel and variant the facade (pie.plugins) has checked."""
        variant = request.variant or self.variants()[request.name][0]
        if request.name in PROJECTIONS:
            return self._linear(request.name, variant, float(request.option("eps", 0.0)))
        factory: Callable[[KernelRequest], Launcher] = getattr(self, f"_{request.name}")
        return factory(request)

    def _embedding(self, request: KernelRequest) -> Launcher:
        return embedding_launcher(self._gather_rows(request))

    def _gather_rows(self, request: KernelRequest) -> Launcher:
        entry = self.entries["gather_rows"]
        stored = {t: self.entries[f"gather_rows__{t}"] for t in STORED_TYPES}
        name, empty = request.name, self.backend.empty  # embedding's launcher is this one's

        def gather_rows(x: GpuTensor | StoredTensor, rows: GpuTensor) -> GpuTensor:
            chosen = entry
            if isinstance(x, StoredTensor):  # an embedding table in its stored type
                chosen = stored[x.type]
            else:
                check_rows(name, x)
            source_rows, columns = x.shape
            count = check_indices(name, rows)
            out = empty((count, columns), F32)
            for first, bound_rows, table in self._weight_launches(name, x):
                inputs = {1: table, 2: rows, 3: out, 4: table}
                for launch_rows, bound in self._row_launches(count, inputs, (2, 3)):  # indices, out
                    values = {"rows": launch_rows, "columns": columns, "source_rows": source_rows,
                              "first_row": first, "bound_rows": bound_rows}
                    self._elementwise(chosen, launch_rows * columns, values, bound)
            return out

        return gather_rows

    def _rms_norm(self, request: KernelRequest) -> Launcher:
        entry = self.entries["rms_norm"]
        eps = float(request.option("eps"))
        empty = self.backend.empty

        def rms_norm(x: GpuTensor, weight: GpuTensor) -> GpuTensor:
            rows, columns = check_rows("rms_norm", x)
            check_norm_weight("rms_norm", weight, columns)
            _check(rows <= MAX_GROUPS, f"rms_norm: at most {MAX_GROUPS} rows per launch")
            out = empty(x.shape, F32)
            for count, bound in self._row_launches(rows, {1: x, 2: weight, 3: out}, (1, 3)):
                self._run(entry, {"rows": count, "columns": columns, "eps": eps}, bound, (count, 1, 1))
            return out

        return rms_norm

    def _rms_norm_heads(self, request: KernelRequest) -> Launcher:
        entry = self.entries["rms_norm_heads"]
        eps, head_dim = float(request.option("eps")), int(request.option("head_dim"))
        empty = self.backend.empty

        def rms_norm_heads(x: GpuTensor, weight: GpuTensor) -> GpuTensor:
            rows = check_rows("rms_norm_heads", x)[0] * check_heads("rms_norm_heads", x, head_dim)
            check_norm_weight("rms_norm_heads", weight, head_dim)
            out = empty(x.shape, F32)
            if rows:
                groups = _fold(rows)
                values = {"rows": rows, "head_dim": head_dim, "eps": eps, "groups_x": groups[0]}
                self._run(entry, values, {1: x, 2: weight, 3: out}, groups)
            return out

        return rms_norm_heads

    def _add(self, request: KernelRequest) -> Launcher:
        entry = self.entries["add"]
        empty = self.backend.empty

        def add(a: GpuTensor, b: GpuTensor) -> GpuTensor:
            check_add(a, b)
            out = empty(a.shape, F32)
            self._elementwise_rows(entry, "count", 1, {"count": out.size}, {1: a, 2: b, 3: out}, (1, 2, 3))
            return out

        return add

    def _slice_columns(self, request: KernelRequest) -> Launcher:
        entry = self.entries["slice_columns"]
        start, stop = int(request.option("start")), int(request.option("stop"))
        empty = self.backend.empty

        def slice_columns(x: GpuTensor) -> GpuTensor:
            rows = check_slice_columns(x, start, stop)
            out = empty((rows, stop - start), F32)
            values = {"rows": rows, "width": x.shape[1], "start": start, "columns": stop - start}
            self._elementwise_rows(entry, "rows", stop - start, values, {1: x, 2: out}, (1, 2))
            return out

        return slice_columns

    def _silu_mul(self, request: KernelRequest) -> Launcher:
        entry = self.entries["silu_mul"]
        empty = self.backend.empty

        def silu_mul(gate_up: GpuTensor) -> GpuTensor:
            rows, half = check_silu_mul(gate_up)
            out = empty((rows, half), F32)
            values = {"rows": rows, "half_width": half}
            self._elementwise_rows(entry, "rows", half, values, {1: gate_up, 2: out}, (1, 2))
            return out

        return silu_mul

    def _rope(self, request: KernelRequest) -> Launcher:
        entry = self.entries["rope"]
        head_dim = int(request.option("head_dim"))
        empty = self.backend.empty

        def rope(x: GpuTensor, positions: GpuTensor, inv_freq: GpuTensor) -> GpuTensor:
            tokens, heads = check_rope(x, positions, inv_freq, head_dim)
            out = empty(x.shape, F32)
            values = {"tokens": tokens, "heads": heads, "half_dim": head_dim // 2}
            self._elementwise(
                entry, tokens * heads * (head_dim // 2), values, {1: x, 2: positions, 3: inv_freq, 4: out}
            )
            return out

        return rope

    def _pool_entries(self, name: str) -> dict[str, Entry]:
        """The entry points of ``name`` by the numpy name of the pool's type."""
        return {kv: self.entries[name + suffix] for kv, suffix in _KV_ENTRY_SUFFIX.items()}

    def _append_kv(self, request: KernelRequest) -> Launcher:
        entries = self._pool_entries("append_kv")
        layer = int(request.option("layer"))

        def append_kv(pool: GpuTensor, k: GpuTensor, v: GpuTensor, slots: GpuTensor) -> None:
            tokens = check_append_kv(pool, k, v, slots)
            page_size, kv_heads, head_dim = pool.shape[3:]
            width = kv_heads * head_dim
            entry = _pool_entry(entries, pool)
            binding, base = self._layer("append_kv", pool, layer)
            values = {"tokens": tokens, "kv_width": width, "page_size": page_size, "layer_base": base}
            inputs = {1: binding, 2: k, 3: v, 4: slots, 5: binding}  # 5: a 16-bit pool's words
            invocations = k.size if pool.dtype == F32 else k.size // 2  # 16-bit pools: one a word of two elements
            self._elementwise(entry, invocations, values, inputs)

        return append_kv

    def _attention(self, request: KernelRequest) -> Launcher:
        chosen = request.variant or VARIANTS["attention"][0]
        entries = {v: self._pool_entries(f"attention__{v}") for v in ("group", "serial")}
        layer, num_heads, scale, window, softcap = attention_request(request)
        empty = self.backend.empty

        def attention(
            q: GpuTensor,
            pool: GpuTensor,
            qo_indptr: GpuTensor,
            kv_page_indices: GpuTensor,
            kv_page_indptr: GpuTensor,
            kv_last_page_lens: GpuTensor,
        ) -> GpuTensor:
            tokens = check_attention(q, pool, num_heads)
            page_size, kv_heads, head_dim = pool.shape[3:]
            _check(head_dim <= MAX_HEAD_DIM, f"attention: head_dim {head_dim} exceeds {MAX_HEAD_DIM}")
            _check(tokens <= MAX_GROUPS, f"attention: at most {MAX_GROUPS} tokens per launch")
            batch = check_page_tables(qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)
            out = empty(q.shape, F32)
            if tokens:
                # float4 rows, and the pass's longest sequence within the loop cap of software devices; else group
                plan = getattr(self.backend, "pass_plan", None)
                longest = plan.max_kv_len if plan is not None else kv_page_indices.shape[0] * page_size
                if window:
                    longest = min(longest, window)
                serial = chosen == "serial" and head_dim % 4 == 0 and longest <= serial_attention_keys(head_dim)
                entry = _pool_entry(entries["serial" if serial else "group"], pool)
                binding, base = self._layer("attention", pool, layer, VECTOR_ALIGNMENT if serial else 4)
                values = {
                    "tokens": tokens,
                    "batch": batch,
                    "num_heads": num_heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "page_size": page_size,
                    "layer_base": base,
                    "scale": scale,
                    "window": window,
                    "softcap": softcap,
                    "key_begin": 0,
                    "key_count": longest,
                    "resume": 0,
                    "finish": 1,
                }
                inputs: dict[int, GpuTensor | BufferRange | None] = {
                    1: q,
                    2: binding,
                    3: qo_indptr,
                    4: kv_page_indices,
                    5: kv_page_indptr,
                    6: kv_last_page_lens,
                    7: out,
                    10: binding,  # a 16-bit pool's words
                }
                if serial:
                    lanes = entry.workgroup[0]
                    # float4 views; 11: a 16-bit pool's pairs of words
                    views: dict[int, GpuTensor | BufferRange | None] = {8: binding, 9: q, 11: binding}
                    self._run(entry, values, {**inputs, **views}, (-(-num_heads // lanes), tokens, 1))
                    return out
                # Key ranges within the loop cap in turn; the running max and sum of each (token, head) between them.
                span = group_attention_keys(head_dim)
                state = empty((tokens, num_heads, 2), F32) if longest > span else None
                for begin in range(0, max(longest, 1), span):
                    ranged = {"key_begin": begin, "key_count": span, "resume": int(begin > 0)}
                    ranged["finish"] = int(begin + span >= longest)
                    self._run(entry, {**values, **ranged}, {**inputs, 12: state}, (num_heads, tokens, 1))
            return out

        return attention

    def _argmax(self, request: KernelRequest) -> Launcher:
        entry = self.entries["argmax"]
        empty = self.backend.empty

        def argmax(x: GpuTensor) -> GpuTensor:
            rows, columns = check_rows("argmax", x)
            _check(rows <= MAX_GROUPS, f"argmax: at most {MAX_GROUPS} rows per launch")
            out = empty((rows,), I32)
            for count, bound in self._row_launches(rows, {1: x, 2: out}, (1, 2)):
                self._run(entry, {"rows": count, "columns": columns}, bound, (count, 1, 1))
            return out

        return argmax

    def _softmax(self, request: KernelRequest) -> Launcher:
        entry = self.entries["softmax"]
        inverse = 1.0 / float(request.option("temperature"))
        empty = self.backend.empty

        def softmax(x: GpuTensor) -> GpuTensor:
            rows, columns = check_rows("softmax", x)
            _check(rows <= MAX_GROUPS, f"softmax: at most {MAX_GROUPS} rows per launch")
            out = empty(x.shape, F32)
            for count, bound in self._row_launches(rows, {1: x, 2: out}, (1, 2)):
                values = {"rows": count, "columns": columns, "inv_temperature": inverse}
                self._run(entry, values, bound, (count, 1, 1))
            return out

        return softmax

    def _top_k(self, request: KernelRequest) -> Launcher:
        entry = self.entries["top_k"]
        k = int(request.option("k"))
        empty = self.backend.empty

        def top_k(x: GpuTensor) -> tuple[GpuTensor, GpuTensor]:
            rows, columns = check_top_k(x, k)
            _check(rows <= MAX_GROUPS, f"top_k: at most {MAX_GROUPS} rows per launch")
            values, indices = empty((rows, k), F32), empty((rows, k), I32)
            # Rounds a launch, within the loop cap of software devices: a round passes over the row in strides of
            # 256 lanes, then the workgroup's argmax (8 steps) and the loops' exits.
            per_launch = max(1, (LOOP_ITERATIONS - 64) // (-(-columns // 256) + 12))
            for count, bound in self._row_launches(rows, {1: x, 2: values, 3: indices}, (1, 2, 3)):
                for first in range(0, k, per_launch):
                    sizes = {"rows": count, "columns": columns, "k": k, "first": first}
                    self._run(entry, sizes, bound, (count, 1, 1))
            return values, indices

        return top_k

    def _epilogue(self, request: KernelRequest) -> Launcher:
        program = EpilogueProgram(request, self.epilogue_target)
        layout = program.layout
        storage = tuple((b.slot, "read" if b.role == "input" else "read_write") for b in layout.buffers)
        bindings = tuple(sorted((*storage, (layout.params_slot, "uniform"))))
        fields = tuple((f.name, f.storage) for f in layout.fields)
        rendered = program.rendered
        entry = Entry(rendered.entry_point, "eta", (layout.workgroup_size, 1, 1), bindings, fields, rendered.source)  # type: ignore[arg-type]
        empty = self.backend.empty

        def epilogue(*inputs: GpuTensor) -> GpuTensor:
            rows, cols, outputs = program.outputs(inputs, empty)
            tensors = {slot: tensor for slot, tensor in enumerate([*inputs, *outputs])}
            if rows * cols:
                for count, ranged in self._row_launches(rows, tensors, program.row_slots):
                    x, y = layout.groups(count, cols)
                    bound = [self._bind(ranged[index]) for index, _ in entry.storage_bindings]
                    self.backend.dispatch(entry, program.packed_params(count, cols), bound, (x, y, 1))
            return outputs[0]

        return epilogue

    def _linear(self, kernel: str, variant: str, eps: float) -> Launcher:
        entries = {v: self.entries[f"{kernel}__{v}"] for v in LINEAR_VARIANTS}
        stored = {t: {v: self.entries[f"{kernel}__{v}__{t}"] for v in LINEAR_VARIANTS} for t in STORED_TYPES}
        empty = self.backend.empty
        run_entry = self._run
        unfused = None
        if kernel == GATED:
            norm_linear = self._linear("rms_norm_linear", variant, eps)
            silu_mul = self.compile(KernelRequest("silu_mul"))

            def unfused(x: GpuTensor, weight: GpuTensor | StoredTensor, norm_weight: GpuTensor | None) -> GpuTensor:
                return silu_mul(norm_linear(x, norm_weight, weight))

        def run(
            x: GpuTensor,
            weight: GpuTensor | StoredTensor,
            bias: GpuTensor | None,
            residual: GpuTensor | None,
            norm_weight: GpuTensor | None,
        ) -> GpuTensor:
            tokens, k, n = check_projection(kernel, x, weight, bias, residual, norm_weight)
            if not isinstance(weight, StoredTensor):  # a dense weight is read as float32
                expect(weight, "float32", 2, kernel, "weight")
            if unfused is not None and _weight_bytes(weight) > self.backend.max_binding_bytes:
                return unfused(x, weight, norm_weight)
            out = empty((tokens, n), F32)
            if tokens == 0 or n == 0:
                return out
            chosen = variant
            tensors: dict[int, GpuTensor | StoredTensor | None] = {
                1: x,
                2: weight,
                3: bias,
                4: norm_weight,
                5: residual,
                6: out,
            }
            chosen_entries = entries
            if isinstance(weight, StoredTensor):  # its words at binding 10, the kernels of its type
                chosen_entries = stored[weight.type]
                tensors[10] = weight
            # Where loops are capped (LOOP_ITERATIONS) a variant whose invocations walk a whole row cannot be right
            # past it: a tile of 16 inputs takes 18 iterations (naga's SPIR-V, wgpu), a float4 of the rows family one.
            tile_fits = -(-k // 16) * 18 <= LOOP_ITERATIONS - 64
            if chosen.startswith("tile") and not tile_fits:
                chosen = "rows_b8"
            rows_fit = k % 4 == 0 and k // 4 <= LOOP_ITERATIONS  # a float4 view, walked within the loop cap
            if chosen.startswith("rows") and not rows_fit:  # the gemv variant with the same token batch
                chosen = chosen.replace("rows", "gemv")
            if chosen.startswith("gemv") and -(-n // _GROUP_SHAPE[chosen][0]) > MAX_GROUPS:
                # Two or four columns a workgroup: Gemma 3's 262,144-word head would take 65,536 workgroups or more.
                # The rows variant with the same token batch, or where no float4 view holds a row, 16 columns a tile.
                if rows_fit:
                    chosen = chosen.replace("gemv", "rows")
                elif tile_fits:
                    chosen = "tile16"
            if chosen.startswith("rows"):
                tensors.update({vector: tensors.get(scalar) for scalar, vector in _VECTOR_BINDINGS.items()})
            columns, token_rows = _GROUP_SHAPE[chosen]
            groups = (-(-n // columns), -(-tokens // token_rows), 1)
            _check(max(groups) <= MAX_GROUPS, f"{kernel}[{chosen}]: grid {groups} exceeds the device limit")
            values = {"inputs": k, "has_bias": int(bias is not None), "eps": eps, "out_stride": n}
            # The gated kernel's weight whole (within the binding, above): n gate rows, then n up rows.
            launches = [(0, n, weight)] if unfused is not None else list(self._weight_launches(kernel, weight))
            for first, count, bound_weight in launches:  # chunks of output columns where the weight needs them
                chunk: dict[int, GpuTensor | StoredTensor | BufferRange | None] = {
                    slot: bound_weight if tensor is weight else tensor for slot, tensor in tensors.items()
                }
                if len(launches) > 1 and bias is not None:
                    chunk[3] = (bias.buffer, first * 4, count * 4)
                for launch_tokens, bound in self._row_launches(tokens, chunk, _TOKEN_ROWS):  # x, residual, out, x4
                    if len(launches) > 1:  # the token rows' output and residual from the chunk's first column
                        for slot in _OUTPUT_ROWS:
                            if bound.get(slot) is not None:
                                buffer, offset, _ = self._bind(bound[slot])
                                size = ((launch_tokens - 1) * n + count) * 4
                                bound[slot] = (buffer, offset + first * 4, size)
                    groups = (-(-count // columns), -(-launch_tokens // token_rows), 1)
                    launch = {**values, "outputs": count, "tokens": launch_tokens}
                    run_entry(chosen_entries[chosen], launch, bound, groups)
            return out

        return projection_launcher(kernel, run)
