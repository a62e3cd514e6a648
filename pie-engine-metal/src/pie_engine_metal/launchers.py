"""Launchers: one closure per compiled catalogue kernel.

Compiling a kernel builds its pipelines (once, cached by the device) and returns a closure that
checks shapes, allocates the output, sizes the grid (:mod:`pie_engine_metal.plan`) and encodes the
dispatch. Nothing waits for the GPU here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pie.contract import KernelRequest
from pie.enginekit.catalogue import (
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
    expect,
    pool_layer,
    projection_launcher,
)
from pie.enginekit.tensor import GpuTensor, StoredTensor
from pie.kernels import PROJECTIONS
from pie.weights import F32 as F32_TYPE

from pie_engine_metal import plan
from pie_engine_metal.context import I32, Kernel, OpenedDevice
from pie_engine_metal.weights import TYPE_CODES

Launcher = Callable[..., Any]

SINGLE = "msl"
"""The variant name of kernels that have one implementation."""
LINEAR_VARIANTS = ("tiled", "gemv")
"""Projection variants, the default first; GPUs with simdgroup matrices list :data:`SIMDGROUP_VARIANT`
first instead. The engine's default profile runs GEMV for decode-sized batches."""
SIMDGROUP_VARIANT = "simdgroup"
ROW_REDUCTIONS = ("rms_norm", "rms_norm_heads", "softmax", "argmax")


def _weight(tensor: Any, kernel: str) -> tuple[GpuTensor, str, tuple[int, ...]]:
    """The buffer's tensor, the type and the [rows, columns] of a weight in any type the kernels read."""
    if isinstance(tensor, StoredTensor):
        return tensor.words, tensor.type, tensor.shape
    return expect(tensor, "float32", 2, kernel, "weight"), F32_TYPE, tensor.shape


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _pool_layer(pool: Any, layer: int, kernel: str) -> tuple[tuple[int, ...], tuple[Any, int]]:
    """A float32 page pool ``[layers, pages, 2, page_size, heads, dim]``'s shape and its layer's binding (the
    kernel's own check, ``check_append_kv`` or ``check_attention``, checks it is a page pool)."""
    shape = tuple(expect(pool, "float32", 6, kernel, "pool").shape)
    return shape, (pool.buffer, pool_layer(kernel, pool, layer)[0])


# -- elementwise ----------------------------------------------------------------


def _embedding(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    kernels = {F32_TYPE: ctx.kernel("embedding", table_type=TYPE_CODES[F32_TYPE])}

    def embedding(ids: GpuTensor, table: GpuTensor | StoredTensor) -> GpuTensor:
        tokens = check_indices("embedding", ids)
        words, weight_type, (vocab, dim) = _weight(table, "embedding")
        kernel = kernels.get(weight_type)
        if kernel is None:
            kernel = kernels[weight_type] = ctx.kernel("embedding", table_type=TYPE_CODES[weight_type])
        out = ctx.empty((tokens, dim))
        kernel((ids, words, out), (tokens, dim, vocab), plan.grid_2d(dim, tokens))
        return out

    return embedding


def _add(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    kernel = ctx.kernel("add")

    def add(a: GpuTensor, b: GpuTensor) -> GpuTensor:
        check_add(a, b)
        out = ctx.empty(a.shape)
        kernel((a, b, out), (a.size,), plan.grid_1d(a.size))
        return out

    return add


def _slice_columns(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    start, stop = int(request.option("start")), int(request.option("stop"))
    _check(0 <= start < stop, f"slice_columns: bad range {start}:{stop}")
    kernel = ctx.kernel("slice_columns", slice_start=start)

    def slice_columns(x: GpuTensor) -> GpuTensor:
        rows = check_slice_columns(x, start, stop)
        width = x.shape[1]
        out = ctx.empty((rows, stop - start))
        kernel((x, out), (rows, width, stop - start), plan.grid_2d(stop - start, rows))
        return out

    return slice_columns


def _silu_mul(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    kernel = ctx.kernel("silu_mul")

    def silu_mul(gate_up: GpuTensor) -> GpuTensor:
        rows, half = check_silu_mul(gate_up)
        out = ctx.empty((rows, half))
        kernel((gate_up, out), (rows, half), plan.grid_2d(half, rows))
        return out

    return silu_mul


def _rope(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    head_dim = int(request.option("head_dim"))
    _check(head_dim > 0 and head_dim % 2 == 0, f"rope: head_dim {head_dim} must be positive and even")
    kernel = ctx.kernel("rope", rope_head_dim=head_dim)

    def rope(x: GpuTensor, positions: GpuTensor, inv_freq: GpuTensor) -> GpuTensor:
        tokens, heads = check_rope(x, positions, inv_freq, head_dim)
        out = ctx.empty(x.shape)
        kernel((x, positions, inv_freq, out), (tokens, heads), plan.grid_rope(head_dim // 2, heads, tokens))
        return out

    return rope


def _gather_rows(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    kernel = ctx.kernel("gather_rows")

    def gather_rows(x: GpuTensor, rows: GpuTensor) -> GpuTensor:
        source_rows, cols = check_rows("gather_rows", x)
        count = check_indices("gather_rows", rows)
        out = ctx.empty((count, cols))
        kernel((x, rows, out), (count, cols, source_rows), plan.grid_2d(cols, count))
        return out

    return gather_rows


def _append_kv(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    layer = int(request.option("layer"))
    kernel = ctx.kernel("append_kv")

    def append_kv(pool: GpuTensor, k: GpuTensor, v: GpuTensor, slots: GpuTensor) -> None:
        (_, pages, _, page_size, heads, dim), binding = _pool_layer(pool, layer, "append_kv")
        width = heads * dim
        tokens = check_append_kv(pool, k, v, slots)
        kernel((binding, k, v, slots), (tokens, width, page_size, pages), plan.grid_2d(width, tokens))

    return append_kv


# -- row reductions -------------------------------------------------------------


def _rows(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    """rms_norm, rms_norm_heads (each head's values one row of rms_norm), softmax and argmax: one
    threadgroup a row."""
    name = request.name
    if name == "softmax":
        kernel = ctx.kernel("softmax", temperature=float(request.option("temperature")))
    elif name == "argmax":
        kernel = ctx.kernel("argmax")
    else:
        kernel = ctx.kernel("rms_norm", eps=float(request.option("eps")))
    head_dim = int(request.option("head_dim")) if name == "rms_norm_heads" else 0
    simd_width, max_threads = kernel.pipeline.simd_width, kernel.pipeline.max_threads

    def reduce(x: GpuTensor, weight: GpuTensor | None = None) -> GpuTensor:
        rows, cols = check_rows(name, x)
        if head_dim:
            rows, cols = rows * check_heads(name, x, head_dim), head_dim
        if weight is not None:
            check_norm_weight(name, weight, cols)
        out = ctx.empty((rows,), I32) if name == "argmax" else ctx.empty(x.shape)
        inputs = (x,) if weight is None else (x, weight)
        kernel((*inputs, out), (rows, cols), plan.grid_rows(rows, cols, simd_width, max_threads))
        return out

    if name in ("softmax", "argmax"):
        return lambda x: reduce(x)
    return reduce


# -- projections ----------------------------------------------------------------


def _projection(ctx: OpenedDevice, request: KernelRequest, simdgroup_matrices: bool) -> Launcher:
    """linear and its fused forms: one kernel family, specialised by function constants."""
    name = request.name
    strategy = request.variant or variants(simdgroup_matrices)[name][0]
    has_norm = name in ("rms_norm_linear", "rms_norm_gate_up_silu")
    gated = name == "rms_norm_gate_up_silu"
    constants = {"has_norm": has_norm, "gated": gated, "has_residual": name == "linear_add"}

    def specialise(with_bias: bool, weight_type: str) -> Kernel:
        return ctx.kernel(f"linear_{strategy}", has_bias=with_bias, weight_type=TYPE_CODES[weight_type], **constants)

    # Float32 weights' pipelines are built now; those of stored types on first use.
    bias_options = (False, True) if name in ("linear", "rms_norm_linear") else (False,)
    kernels = {(with_bias, F32_TYPE): specialise(with_bias, F32_TYPE) for with_bias in bias_options}
    inverse_rms = ctx.kernel("inverse_rms", eps=float(request.option("eps"))) if has_norm else None
    placeholder = (ctx.placeholder, 0)

    def project(
        x: GpuTensor,
        weight: GpuTensor | StoredTensor,
        bias: GpuTensor | None,
        residual: GpuTensor | None,
        norm_weight: GpuTensor | None,
    ) -> GpuTensor:
        tokens, k, out_features = check_projection(name, x, weight, bias, residual, norm_weight)
        words, weight_type, _ = _weight(weight, name)
        key = (bias is not None, weight_type)
        kernel = kernels.get(key)
        if kernel is None:
            kernel = kernels[key] = specialise(*key)
        scales: Any = placeholder
        if inverse_rms is not None:
            scales = ctx.empty((tokens,))
            pipe = inverse_rms.pipeline
            inverse_rms((x, scales), (tokens, k), plan.grid_rows(tokens, k, pipe.simd_width, pipe.max_threads))
        out = ctx.empty((tokens, out_features))
        tensors = (x, words, bias or placeholder, norm_weight or placeholder, scales, residual or placeholder, out)
        grid = plan.grid_linear(strategy, tokens, out_features, kernel.pipeline.simd_width)
        kernel(tensors, (tokens, k, out_features), grid)
        return out

    return projection_launcher(name, project)


# -- attention ------------------------------------------------------------------


def _attention(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    """Decode passes (every sequence brings one token, the pass plan's ``decode_only``) run
    ``attention_decode``, whose simdgroups split each token's keys; every other pass runs
    ``attention_prefill``, whose tokens of one sequence share key tiles."""
    layer, num_heads, scale, window, softcap = attention_request(request)
    constants = {"scale": scale, "window": window, "softcap": softcap}
    kernels = {kind: ctx.kernel(f"attention_{kind}", **constants) for kind in plan.ATTENTION_KINDS}

    def attention(
        q: GpuTensor,
        pool: GpuTensor,
        qo_indptr: GpuTensor,
        kv_page_indices: GpuTensor,
        kv_page_indptr: GpuTensor,
        kv_last_page_lens: GpuTensor,
    ) -> GpuTensor:
        (_, pages, _, page_size, kv_heads, head_dim), binding = _pool_layer(pool, layer, "attention")
        tokens = check_attention(q, pool, num_heads)
        width = q.shape[1]
        tables = (qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)
        num_seqs = check_page_tables(*tables)
        # Outside a pass (a launch on its own) the batch's shapes say it: one token per sequence.
        decode_only = ctx.pass_plan.decode_only if ctx.pass_plan is not None else tokens == num_seqs
        kind = "decode" if decode_only else "prefill"
        kernel = kernels[kind]
        out = ctx.empty((tokens, width))
        tensors = (q, binding, qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens, out)
        params = (tokens, num_seqs, num_heads, kv_heads, head_dim, page_size, pages)
        kernel(tensors, params, plan.grid_attention(kind, tokens, num_heads, head_dim, kernel.pipeline.simd_width))
        return out

    return attention


BUILDERS: dict[str, Callable[[OpenedDevice, KernelRequest], Launcher]] = {
    "embedding": _embedding,
    "add": _add,
    "slice_columns": _slice_columns,
    "silu_mul": _silu_mul,
    "rope": _rope,
    "gather_rows": _gather_rows,
    "append_kv": _append_kv,
    "attention": _attention,
    **dict.fromkeys(ROW_REDUCTIONS, _rows),
}
"""The launcher builder of every kernel but the projections."""


def variants(simdgroup_matrices: bool) -> dict[str, tuple[str, ...]]:
    """Catalogue kernels this engine implements, each with its variants (first: default)."""
    projection = (SIMDGROUP_VARIANT, *LINEAR_VARIANTS) if simdgroup_matrices else LINEAR_VARIANTS
    return {**dict.fromkeys(BUILDERS, (SINGLE,)), **dict.fromkeys(PROJECTIONS, projection)}


def libraries_of(kernel: str) -> tuple[str, ...]:
    """The .metal files a catalogue kernel's launcher uses."""
    if kernel in PROJECTIONS:
        return ("rows", "linear") if kernel.startswith("rms_norm") else ("linear",)
    if kernel in ROW_REDUCTIONS:
        return ("rows",)
    return ("attention",) if kernel == "attention" else ("elementwise",)


def build(ctx: OpenedDevice, request: KernelRequest, simdgroup_matrices: bool) -> Launcher:
    """The launcher of ``request`` on ``ctx``'s device (its pipelines are built now)."""
    if request.name in PROJECTIONS:
        return _projection(ctx, request, simdgroup_matrices)
    return BUILDERS[request.name](ctx, request)
