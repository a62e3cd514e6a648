"""Launchers: one closure per compiled catalogue kernel.

Compiling a kernel builds its pipelines (once, cached by the context) and returns a
closure that checks shapes, allocates the output, plans the grid and encodes the
dispatch. Nothing waits for the GPU here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pie.contract import KernelRequest
from pie.kernels import attention_options, heads_of
from pie.weights import F32 as F32_TYPE

from pie_engine_metal import plan
from pie_engine_metal.ane import AneOffload
from pie_engine_metal.context import F32, I32, MetalTensor, OpenedDevice
from pie_engine_metal.driver import Pipeline
from pie_engine_metal.library import FUNCTIONS
from pie_engine_metal.weights import TYPE_CODES

Launcher = Callable[..., Any]

LINEAR_VARIANTS = ("auto", "gemv", "tiled")
SIMDGROUP_VARIANT = "simdgroup"
ATTENTION_VARIANTS = ("auto", "decode", "prefill")
PROJECTIONS = ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu")
ROW_REDUCTIONS = ("rms_norm", "rms_norm_heads", "softmax", "argmax")
ELEMENTWISE = ("embedding", "add", "slice_columns", "silu_mul", "rope", "gather_rows")


def _expect(tensor: Any, dtype: Any, ndim: int, what: str) -> MetalTensor:
    if not isinstance(tensor, MetalTensor):
        raise TypeError(f"{what}: expected a Metal tensor, got {type(tensor).__name__}")
    if tensor.buffer is None:
        raise ValueError(f"{what}: the tensor was released")
    if tensor.dtype != dtype or len(tensor.shape) != ndim:
        raise ValueError(f"{what}: expected a {ndim}-d {dtype} tensor, got {tensor.shape} {tensor.dtype}")
    return tensor


def _expect_weight(tensor: Any, what: str) -> tuple[int, int]:
    """The rows and columns of a weight matrix in any type the kernels read (``weights.py``)."""
    if isinstance(tensor, MetalTensor) and tensor.weight_type != F32_TYPE:
        _expect(tensor, tensor.dtype, 2, what)
        return tensor.logical_shape
    return _expect(tensor, F32, 2, what).shape


def _at(tensor: MetalTensor, offset: int = 0) -> tuple[Any, int]:
    return tensor.buffer, offset


def _elementwise(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    name = request.name
    fn = FUNCTIONS[name]

    if name == "embedding":
        pipes = {F32_TYPE: ctx.pipeline("embedding", table_type=TYPE_CODES[F32_TYPE])}

        def embedding(ids: MetalTensor, table: MetalTensor) -> MetalTensor:
            _expect(ids, I32, 1, "embedding ids")
            vocab, dim = _expect_weight(table, "embedding table")
            pipe = pipes.get(table.weight_type)
            if pipe is None:
                pipe = pipes[table.weight_type] = ctx.pipeline("embedding", table_type=TYPE_CODES[table.weight_type])
            out = ctx.empty((ids.shape[0], dim))
            groups, threads = plan.grid_2d(dim, ids.shape[0])
            ctx.dispatch(pipe, fn, (_at(ids), _at(table), _at(out)), fn.pack(ids.shape[0], dim, vocab), groups, threads)
            return out

        return embedding

    if name == "add":
        pipe = ctx.pipeline("add")

        def add(a: MetalTensor, b: MetalTensor) -> MetalTensor:
            _expect(a, F32, 2, "add a")
            if _expect(b, F32, 2, "add b").shape != a.shape:
                raise ValueError(f"add: shapes {a.shape} and {b.shape} differ")
            out = ctx.empty(a.shape)
            groups, threads = plan.grid_1d(a.size)
            ctx.dispatch(pipe, fn, (_at(a), _at(b), _at(out)), fn.pack(a.size), groups, threads)
            return out

        return add

    if name == "slice_columns":
        start, stop = int(request.option("start")), int(request.option("stop"))
        if not 0 <= start <= stop:
            raise ValueError(f"slice_columns: bad range {start}:{stop}")
        pipe = ctx.pipeline("slice_columns", slice_start=start)

        def slice_columns(x: MetalTensor) -> MetalTensor:
            rows, width = _expect(x, F32, 2, "slice_columns x").shape
            if stop > width:
                raise ValueError(f"slice_columns: {start}:{stop} is outside {width} columns")
            out = ctx.empty((rows, stop - start))
            groups, threads = plan.grid_2d(stop - start, rows)
            ctx.dispatch(pipe, fn, (_at(x), _at(out)), fn.pack(rows, width, stop - start), groups, threads)
            return out

        return slice_columns

    if name == "silu_mul":
        pipe = ctx.pipeline("silu_mul")

        def silu_mul(gate_up: MetalTensor) -> MetalTensor:
            rows, width = _expect(gate_up, F32, 2, "silu_mul gate_up").shape
            if width % 2:
                raise ValueError(f"silu_mul: width {width} is odd")
            out = ctx.empty((rows, width // 2))
            groups, threads = plan.grid_2d(width // 2, rows)
            ctx.dispatch(pipe, fn, (_at(gate_up), _at(out)), fn.pack(rows, width // 2), groups, threads)
            return out

        return silu_mul

    if name == "rope":
        head_dim = int(request.option("head_dim"))
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"rope: head_dim {head_dim} must be positive and even")
        pipe = ctx.pipeline("rope", rope_head_dim=head_dim)

        def rope(x: MetalTensor, positions: MetalTensor, inv_freq: MetalTensor) -> MetalTensor:
            tokens, width = _expect(x, F32, 2, "rope x").shape
            _expect(positions, I32, 1, "rope positions")
            _expect(inv_freq, F32, 1, "rope inv_freq")
            if width % head_dim or positions.shape[0] != tokens or inv_freq.shape[0] != head_dim // 2:
                raise ValueError(
                    f"rope: x {x.shape}, positions {positions.shape}, inv_freq {inv_freq.shape}, head_dim {head_dim}"
                )
            out = ctx.empty(x.shape)
            heads = width // head_dim
            groups, threads = plan.grid_rope(head_dim // 2, heads, tokens)
            ctx.dispatch(
                pipe, fn, (_at(x), _at(positions), _at(inv_freq), _at(out)), fn.pack(tokens, heads), groups, threads
            )
            return out

        return rope

    if name == "gather_rows":
        pipe = ctx.pipeline("gather_rows")

        def gather_rows(x: MetalTensor, rows: MetalTensor) -> MetalTensor:
            source_rows, cols = _expect(x, F32, 2, "gather_rows x").shape
            count = _expect(rows, I32, 1, "gather_rows rows").shape[0]
            out = ctx.empty((count, cols))
            groups, threads = plan.grid_2d(cols, count)
            ctx.dispatch(pipe, fn, (_at(x), _at(rows), _at(out)), fn.pack(count, cols, source_rows), groups, threads)
            return out

        return gather_rows

    raise KeyError(name)


def _row_reduction(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    name = request.name
    if name == "rms_norm_heads":
        return _rms_norm_heads(ctx, request)
    fn = FUNCTIONS[name]
    if name == "rms_norm":
        pipe = ctx.pipeline("rms_norm", eps=float(request.option("eps")))

        def rms_norm(x: MetalTensor, weight: MetalTensor) -> MetalTensor:
            rows, cols = _expect(x, F32, 2, "rms_norm x").shape
            if _expect(weight, F32, 1, "rms_norm weight").shape != (cols,):
                raise ValueError(f"rms_norm: weight {weight.shape} for {cols} columns")
            out = ctx.empty(x.shape)
            groups, threads = plan.grid_rows(rows, cols, pipe.simd_width, pipe.max_threads)
            ctx.dispatch(pipe, fn, (_at(x), _at(weight), _at(out)), fn.pack(rows, cols), groups, threads)
            return out

        return rms_norm

    if name == "softmax":
        pipe = ctx.pipeline("softmax", temperature=float(request.option("temperature")))

        def softmax(x: MetalTensor) -> MetalTensor:
            rows, cols = _expect(x, F32, 2, "softmax x").shape
            out = ctx.empty(x.shape)
            groups, threads = plan.grid_rows(rows, cols, pipe.simd_width, pipe.max_threads)
            ctx.dispatch(pipe, fn, (_at(x), _at(out)), fn.pack(rows, cols), groups, threads)
            return out

        return softmax

    if name == "argmax":
        pipe = ctx.pipeline("argmax")

        def argmax(x: MetalTensor) -> MetalTensor:
            rows, cols = _expect(x, F32, 2, "argmax x").shape
            out = ctx.empty((rows,), I32)
            groups, threads = plan.grid_rows(rows, cols, pipe.simd_width, pipe.max_threads)
            ctx.dispatch(pipe, fn, (_at(x), _at(out)), fn.pack(rows, cols), groups, threads)
            return out

        return argmax

    raise KeyError(name)


def _strategies(variant: str, simdgroup_matrices: bool) -> tuple[plan.LinearStrategy, ...]:
    if variant == "auto":
        return ("gemv", "simdgroup" if simdgroup_matrices else "tiled")
    return (plan.linear_strategy(variant, 1, simdgroup_matrices),)


def _projection(ctx: OpenedDevice, request: KernelRequest, simdgroup_matrices: bool, ane: AneOffload | None) -> Launcher:
    """linear and its fused forms: one kernel family, specialised by function constants."""
    name = request.name
    variant = request.variant or "auto"
    has_norm = name in ("rms_norm_linear", "rms_norm_gate_up_silu")
    gated = name == "rms_norm_gate_up_silu"
    has_residual = name == "linear_add"
    bias_options = (False, True) if name in ("linear", "rms_norm_linear") else (False,)

    def specialise(strategy: str, with_bias: bool, weight_type: str) -> Pipeline:
        return ctx.pipeline(
            f"linear_{strategy}", has_bias=with_bias, has_norm=has_norm, gated=gated, has_residual=has_residual,
            weight_type=TYPE_CODES[weight_type],
        )

    # Float32 weights' pipelines are built now; those of stored types on first use.
    pipelines: dict[tuple[str, bool, str], Pipeline] = {
        (strategy, with_bias, F32_TYPE): specialise(strategy, with_bias, F32_TYPE)
        for strategy in _strategies(variant, simdgroup_matrices)
        for with_bias in bias_options
    }
    norm_pipe = ctx.pipeline("inverse_rms", eps=float(request.option("eps"))) if has_norm else None
    norm_fn = FUNCTIONS["inverse_rms"]
    placeholder = (ctx.placeholder, 0)

    def project(
        x: MetalTensor,
        weight: MetalTensor,
        bias: MetalTensor | None,
        norm_weight: MetalTensor | None,
        residual: MetalTensor | None,
    ) -> MetalTensor:
        tokens, k = _expect(x, F32, 2, f"{name} x").shape
        rows, k_w = _expect_weight(weight, f"{name} weight")
        out_features = rows // 2 if gated else rows
        if k_w != k or (gated and rows % 2):
            raise ValueError(f"{name}: x {x.shape} and weight {weight.logical_shape} do not fit")
        if bias is not None and _expect(bias, F32, 1, f"{name} bias").shape != (rows,):
            raise ValueError(f"{name}: bias {bias.shape} for {rows} rows")
        if norm_weight is not None and _expect(norm_weight, F32, 1, f"{name} norm weight").shape != (k,):
            raise ValueError(f"{name}: norm weight {norm_weight.shape} for {k} columns")
        if residual is not None and _expect(residual, F32, 2, f"{name} residual").shape != (tokens, out_features):
            raise ValueError(f"{name}: residual {residual.shape} for output {(tokens, out_features)}")
        if ane is not None and name == "linear" and weight.weight_type == F32_TYPE:
            offloaded = ane.maybe_run(ctx, x, weight, bias)
            if offloaded is not None:
                return offloaded
        strategy = plan.linear_strategy(variant, tokens, simdgroup_matrices)
        key = (strategy, bias is not None, weight.weight_type)
        pipe = pipelines.get(key)
        if pipe is None:
            pipe = pipelines[key] = specialise(*key)
        fn = FUNCTIONS[f"linear_{strategy}"]
        inverse_rms = placeholder
        if norm_pipe is not None:
            scales = ctx.empty((tokens,))
            groups, threads = plan.grid_rows(tokens, k, norm_pipe.simd_width, norm_pipe.max_threads)
            ctx.dispatch(norm_pipe, norm_fn, (_at(x), _at(scales)), norm_fn.pack(tokens, k), groups, threads)
            inverse_rms = _at(scales)
        out = ctx.empty((tokens, out_features))
        groups, threads = plan.grid_linear(strategy, tokens, out_features, pipe.simd_width)
        buffers = (
            _at(x),
            _at(weight),
            placeholder if bias is None else _at(bias),
            placeholder if norm_weight is None else _at(norm_weight),
            inverse_rms,
            placeholder if residual is None else _at(residual),
            _at(out),
        )
        ctx.dispatch(pipe, fn, buffers, fn.pack(tokens, k, out_features), groups, threads)
        return out

    if name == "linear":
        return lambda x, weight, bias=None: project(x, weight, bias, None, None)
    if name == "rms_norm_linear":
        return lambda x, norm_weight, weight, bias=None: project(x, weight, bias, norm_weight, None)
    if name == "linear_add":
        return lambda x, weight, residual: project(x, weight, None, None, residual)
    return lambda x, norm_weight, gate_up: project(x, gate_up, None, norm_weight, None)


def _pool_shape(pool: Any, layer: int, what: str) -> tuple[int, ...]:
    shape = _expect(pool, F32, 6, f"{what} pool").shape
    if shape[2] != 2 or not 0 <= layer < shape[0]:
        raise ValueError(f"{what}: pool {shape} has no layer {layer}")
    return shape


def _layer_offset(shape: tuple[int, ...], layer: int) -> int:
    """Byte offset of one layer in a pool ``[layers, pages, 2, page_size, heads, dim]``."""
    _, pages, two, page_size, heads, dim = shape
    return layer * pages * two * page_size * heads * dim * F32.itemsize


def _append_kv(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    layer = int(request.option("layer"))
    fn = FUNCTIONS["append_kv"]
    pipe = ctx.pipeline("append_kv")

    def append_kv(pool: MetalTensor, k: MetalTensor, v: MetalTensor, slots: MetalTensor) -> None:
        shape = _pool_shape(pool, layer, "append_kv")
        _, pages, _, page_size, heads, dim = shape
        width = heads * dim
        tokens = _expect(slots, I32, 1, "append_kv slots").shape[0]
        for tensor, what in ((k, "k"), (v, "v")):
            if _expect(tensor, F32, 2, f"append_kv {what}").shape != (tokens, width):
                raise ValueError(f"append_kv: {what} {tensor.shape}, expected {(tokens, width)}")
        groups, threads = plan.grid_2d(width, tokens)
        buffers = (_at(pool, _layer_offset(shape, layer)), _at(k), _at(v), _at(slots))
        ctx.dispatch(pipe, fn, buffers, fn.pack(tokens, width, page_size, pages), groups, threads)
        return None

    return append_kv


def _rms_norm_heads(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    """rms_norm over [T * heads, head_dim]: each head's values are one row of the rms_norm kernel."""
    fn, head_dim = FUNCTIONS["rms_norm"], int(request.option("head_dim"))
    pipe = ctx.pipeline("rms_norm", eps=float(request.option("eps")))

    def rms_norm_heads(x: MetalTensor, weight: MetalTensor) -> MetalTensor:
        rows = _expect(x, F32, 2, "rms_norm_heads x").shape[0] * heads_of(x, head_dim)
        if _expect(weight, F32, 1, "rms_norm_heads weight").shape != (head_dim,):
            raise ValueError(f"rms_norm_heads: weight {weight.shape} is not [{head_dim}]")
        out = ctx.empty(x.shape)
        groups, threads = plan.grid_rows(rows, head_dim, pipe.simd_width, pipe.max_threads)
        ctx.dispatch(pipe, fn, (_at(x), _at(weight), _at(out)), fn.pack(rows, head_dim), groups, threads)
        return out

    return rms_norm_heads


def _attention(ctx: OpenedDevice, request: KernelRequest) -> Launcher:
    layer = int(request.option("layer"))
    num_heads = int(request.option("num_heads"))
    variant = request.variant or "auto"
    kinds: tuple[plan.AttentionKind, ...] = (
        ("decode", "prefill") if variant == "auto" else (plan.attention_kind(variant, 0, 0),)
    )
    scale = float(request.option("scale"))
    window, softcap = attention_options(request.option("window"), request.option("softcap"))
    pipelines = {
        kind: ctx.pipeline(f"attention_{kind}", scale=scale, window=window, softcap=softcap) for kind in kinds
    }

    def attention(
        q: MetalTensor,
        pool: MetalTensor,
        qo_indptr: MetalTensor,
        kv_page_indices: MetalTensor,
        kv_page_indptr: MetalTensor,
        kv_last_page_lens: MetalTensor,
    ) -> MetalTensor:
        shape = _pool_shape(pool, layer, "attention")
        _, pages, _, page_size, kv_heads, head_dim = shape
        tokens, width = _expect(q, F32, 2, "attention q").shape
        if width != num_heads * head_dim or num_heads % kv_heads:
            raise ValueError(f"attention: q {q.shape} for {num_heads} heads of {head_dim} over {kv_heads} KV heads")
        num_seqs = _expect(qo_indptr, I32, 1, "attention qo_indptr").shape[0] - 1
        _expect(kv_page_indices, I32, 1, "attention kv_page_indices")
        if _expect(kv_page_indptr, I32, 1, "attention kv_page_indptr").shape[0] != num_seqs + 1:
            raise ValueError("attention: kv_page_indptr and qo_indptr describe different batches")
        if _expect(kv_last_page_lens, I32, 1, "attention kv_last_page_lens").shape[0] != num_seqs:
            raise ValueError("attention: kv_last_page_lens does not match the batch")
        kind = plan.attention_kind(variant, tokens, num_seqs)
        pipe = pipelines[kind]
        fn = FUNCTIONS[f"attention_{kind}"]
        out = ctx.empty((tokens, width))
        groups, threads = plan.grid_attention(kind, tokens, num_heads, head_dim, pipe.simd_width)
        buffers = (
            _at(q),
            _at(pool, _layer_offset(shape, layer)),
            _at(qo_indptr),
            _at(kv_page_indices),
            _at(kv_page_indptr),
            _at(kv_last_page_lens),
            _at(out),
        )
        params = fn.pack(tokens, num_seqs, num_heads, kv_heads, head_dim, page_size, pages)
        ctx.dispatch(pipe, fn, buffers, params, groups, threads)
        return out

    return attention


def variants(simdgroup_matrices: bool) -> dict[str, tuple[str, ...]]:
    """Catalogue kernels this engine implements, each with its variants (first: default)."""
    projection = LINEAR_VARIANTS + ((SIMDGROUP_VARIANT,) if simdgroup_matrices else ())
    listed: dict[str, tuple[str, ...]] = {name: ("msl",) for name in ELEMENTWISE + ROW_REDUCTIONS + ("append_kv",)}
    listed["attention"] = ATTENTION_VARIANTS
    listed |= {name: projection for name in PROJECTIONS}
    return listed


def libraries_of(kernel: str) -> tuple[str, ...]:
    """The .metal files a catalogue kernel's launcher uses."""
    if kernel in PROJECTIONS:
        return ("rows", "linear") if kernel.startswith("rms_norm") else ("linear",)
    if kernel in ROW_REDUCTIONS:
        return ("rows",)
    return ("attention",) if kernel == "attention" else ("elementwise",)


def build(ctx: OpenedDevice, request: KernelRequest, simdgroup_matrices: bool, ane: AneOffload | None = None) -> Launcher:
    """The launcher of ``request`` on ``ctx``'s device (its pipelines are built now)."""
    name = request.name
    if name in PROJECTIONS:
        return _projection(ctx, request, simdgroup_matrices, ane)
    if name in ROW_REDUCTIONS:
        return _row_reduction(ctx, request)
    if name == "append_kv":
        return _append_kv(ctx, request)
    if name == "attention":
        return _attention(ctx, request)
    return _elementwise(ctx, request)
