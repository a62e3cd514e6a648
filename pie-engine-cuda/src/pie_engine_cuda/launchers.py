"""Launchers: every catalogue kernel bound to one device, ready for the hot path.

A factory runs once per compiled kernel: it binds the kernel functions and keeps
one argument struct with the compile-time options already filled in. A launch
then writes the tensor pointers and sizes into that struct, picks the grid from
the shapes and makes one driver call. Outputs are fresh device tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from pie.contract import KernelRequest, Launcher
from pie.enginekit.catalogue import (
    attention_request,
    check_add,
    check_append_kv,
    check_attention,
    check_heads,
    check_matrix,
    check_indices,
    check_norm_weight,
    check_page_tables,
    check_projection,
    check_rope,
    check_rows,
    check_silu_mul,
    check_slice_columns,
    check_top_k,
    embedding_launcher,
    expect,
    pool_layer,
    projection_launcher,
)
from pie.runtime.pass_plan import check_page_table_values, check_slot_values

from pie_engine_cuda import launch as configs
from pie_engine_cuda.api import BoundLaunch
from pie_engine_cuda.args import STRUCTS
from pie_engine_cuda.attention_plan import SPLIT_CHUNK, PassWork
from pie_engine_cuda.epilogues import make_epilogue
from pie_engine_cuda.launch import LaunchConfig
from pie_engine_cuda.runtime import BLOCK_DTYPES, WEIGHT_SUFFIX, GpuDevice
from pie_engine_cuda.tensor import DeviceTensor

PLANNED_ROWS = 256
"""Projections remember their kernel and grid per row count up to this many rows (decode batches)."""

PROJECTION_VARIANTS = ("tc", "gemv", "tiled")
"""On devices with tensor cores, the default first; elsewhere ``tc`` is left out and ``tiled`` leads
(see :func:`kernel_listing`). The engine's default profile runs GEMV for decode-sized batches."""
ATTENTION_VARIANTS = ("decode", "prefill", "split_kv")
"""Every variant runs any ragged batch; the engine's default profile runs prefill tiles for big passes."""

Factory = Callable[[GpuDevice, KernelRequest], Launcher]


def _ptr(tensor: DeviceTensor | None) -> int:
    return 0 if tensor is None else tensor.ptr


# ---------------------------------------------------------------------------------------------
# Elementwise, rows, gathers
# ---------------------------------------------------------------------------------------------


def make_add(rt: GpuDevice, request: KernelRequest) -> Launcher:
    args = STRUCTS["BinaryArgs"]()
    launch = rt.bind("core", "pie_add", args)
    empty, elementwise = rt.empty, configs.elementwise

    def add(a: DeviceTensor, b: DeviceTensor) -> DeviceTensor:
        check_add(a, b)
        out = empty(a.shape)
        n = a.size
        if n:
            args.a, args.b, args.out, args.n = a.ptr, b.ptr, out.ptr, n
            launch(*elementwise(n))
        return out

    return add


def make_silu_mul(rt: GpuDevice, request: KernelRequest) -> Launcher:
    args = STRUCTS["SiluMulArgs"]()
    launch = rt.bind("core", "pie_silu_mul", args)
    empty, elementwise = rt.empty, configs.elementwise

    def silu_mul(gate_up: DeviceTensor) -> DeviceTensor:
        rows, half = check_silu_mul(gate_up)
        out = empty((rows, half))
        n = rows * half
        if n:
            args.x, args.out, args.n, args.half = gate_up.ptr, out.ptr, n, half
            launch(*elementwise(n))
        return out

    return silu_mul


def make_slice_columns(rt: GpuDevice, request: KernelRequest) -> Launcher:
    start, stop = int(request.option("start")), int(request.option("stop"))
    args = STRUCTS["SliceArgs"]()
    args.start, args.count = start, stop - start
    launch = rt.bind("core", "pie_slice_columns", args)
    empty, elementwise = rt.empty, configs.elementwise

    def slice_columns(x: DeviceTensor) -> DeviceTensor:
        rows = check_slice_columns(x, start, stop)
        out = empty((rows, stop - start))
        n = rows * (stop - start)
        if n:
            args.x, args.out, args.n, args.width = x.ptr, out.ptr, n, x.shape[1]
            launch(*elementwise(n))
        return out

    return slice_columns


def make_gather_rows(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """Rows of a table in any weight dtype as float32 (gather_rows, and so embedding)."""
    args = STRUCTS["GatherArgs"]()
    name = request.name
    bound: dict[str, BoundLaunch] = {}
    empty, elementwise = rt.empty, configs.elementwise

    def gather(table: DeviceTensor, rows: DeviceTensor) -> DeviceTensor:
        table_rows, cols = check_matrix(name, "table", table)
        count = check_indices(name, rows)
        out = empty((count, cols))
        n = count * cols
        if n:
            launch = bound.get(table.dtype)
            if launch is None:
                launch = bound[table.dtype] = rt.bind("core", f"pie_gather_{WEIGHT_SUFFIX[table.dtype]}", args)
            args.rows, args.table, args.out, args.n = rows.ptr, table.ptr, out.ptr, n
            args.cols, args.table_rows = cols, table_rows
            launch(*elementwise(n))
        return out

    return gather


def make_embedding(rt: GpuDevice, request: KernelRequest) -> Launcher:
    return embedding_launcher(make_gather_rows(rt, request))


ROW_KERNELS = {
    "rms_norm": ("pie_rms_norm", "RmsArgs", "eps"),
    "rms_norm_heads": ("pie_rms_norm", "RmsArgs", "eps"),
    "softmax": ("pie_softmax", "SoftmaxArgs", "temperature"),
    "argmax": ("pie_argmax", "ArgmaxArgs", None),
}
"""The kernels of one block per row: each one's function, argument struct and the option fixed in it."""


def make_row_kernel(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """rms_norm, rms_norm_heads (over [T * heads, head_dim]: each head's values are one row of the
    rms_norm kernel), softmax and argmax."""
    name = request.name
    function, struct, option = ROW_KERNELS[name]
    args = STRUCTS[struct]()
    if option is not None:
        setattr(args, option, float(request.option(option)))
    launch = rt.bind("core", function, args)
    head_dim = int(request.option("head_dim")) if name == "rms_norm_heads" else 0
    argmax, weighted = name == "argmax", option == "eps"
    empty, per_row = rt.empty, configs.per_row

    def run(x: DeviceTensor, weight: DeviceTensor | None) -> DeviceTensor:
        rows, cols = check_rows(name, x)
        if head_dim:
            rows, cols = rows * check_heads(name, x, head_dim), head_dim
        if weighted:
            check_norm_weight(name, weight, cols)
        out = empty((rows,), "int32") if argmax else empty(x.shape)
        if rows:
            args.x, args.out, args.rows, args.cols = x.ptr, out.ptr, rows, cols
            if weight is not None:
                args.weight = weight.ptr
            launch(*per_row(rows))
        return out

    return run if weighted else lambda x: run(x, None)  # softmax and argmax take no weight


MAX_K = 256
"""PIE_TOPK_MAX in sampling.cu: the candidates one block sorts in shared memory."""


def make_top_k(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """(values float32, indices int32) ``[rows, k]``, best first, ties to the lower index; NaN is skipped,
    and a row with fewer than k numbers pads with index -1 and value -inf. A top-k sampler downloads
    these few numbers instead of the whole vocabulary."""
    k = int(request.option("k"))
    if not 1 <= k <= MAX_K:
        raise ValueError(f"top_k on the CUDA engine needs 1 <= k <= {MAX_K}, not k={k}")
    args = STRUCTS["TopKArgs"]()
    args.k = k
    launch = rt.bind("core", "pie_top_k", args)
    empty, per_row = rt.empty, configs.per_row

    def top_k(logits: DeviceTensor) -> tuple[DeviceTensor, DeviceTensor]:
        rows, cols = check_top_k(logits, k)
        values, indices = empty((rows, k)), empty((rows, k), "int32")
        if rows:
            args.x, args.values, args.indices, args.rows, args.cols = logits.ptr, values.ptr, indices.ptr, rows, cols
            launch(*per_row(rows))
        return values, indices

    return top_k


def make_rope(rt: GpuDevice, request: KernelRequest) -> Launcher:
    head_dim = int(request.option("head_dim"))
    args = STRUCTS["RopeArgs"]()
    args.head_dim = head_dim
    launch = rt.bind("core", "pie_rope", args)
    empty, rope_config = rt.empty, configs.rope

    def rope(x: DeviceTensor, positions: DeviceTensor, inv_freq: DeviceTensor) -> DeviceTensor:
        tokens, heads = check_rope(x, positions, inv_freq, head_dim)
        out = empty(x.shape)
        if tokens and heads:
            args.x, args.positions, args.inv_freq, args.out = x.ptr, positions.ptr, inv_freq.ptr, out.ptr
            args.tokens, args.heads = tokens, heads
            launch(*rope_config(tokens, heads, head_dim))
        return out

    return rope


# ---------------------------------------------------------------------------------------------
# The KV page pool
# ---------------------------------------------------------------------------------------------


def make_append_kv(rt: GpuDevice, request: KernelRequest) -> Launcher:
    layer = int(request.option("layer"))
    args = STRUCTS["AppendKvArgs"]()
    launch = rt.bind("core", "pie_append_kv", args)
    append_config = configs.append_kv

    def append_kv(pool: DeviceTensor, k: DeviceTensor, v: DeviceTensor, slots: DeviceTensor) -> None:
        tokens = check_append_kv(expect(pool, "float32", 6, "append_kv", "pool"), k, v, slots)
        _, num_pages, _, page_size, kv_heads, head_dim = pool.shape
        if rt.pass_plan is None:  # a launch of its own: a slot outside the pool would be written unbounded
            check_slot_values("append_kv", rt.host_view(slots), page_size, num_pages)
        width = kv_heads * head_dim
        if tokens:
            args.pool = pool.ptr + pool_layer("append_kv", pool, layer)[0]
            args.k, args.v, args.slots = k.ptr, v.ptr, slots.ptr
            args.tokens, args.width, args.page_size = tokens, width, page_size
            launch(*append_config(tokens, width))

    return append_kv


class Attention:
    """Paged attention of one layer, through the kernel(s) of its variant."""

    def __init__(
        self, rt: GpuDevice, variant: str, layer: int, num_heads: int, scale: float, window: int, softcap: float
    ):
        self.rt = rt
        self.variant = variant
        self.layer = layer
        self.num_heads = num_heads
        self.window = window
        self.args = args = STRUCTS["AttnArgs"]()
        args.num_heads, args.scale, args.window, args.softcap = num_heads, scale, window, softcap
        self._decode = rt.bind("attention", "pie_attention_decode", args)
        self._split = rt.bind("attention", "pie_attention_split", args)
        self._merge = rt.bind("attention", "pie_attention_merge", args)
        self._prefill = rt.bind("attention", "pie_attention_prefill", args)

    def __call__(
        self,
        q: DeviceTensor,
        pool: DeviceTensor,
        qo_indptr: DeviceTensor,
        kv_page_indices: DeviceTensor,
        kv_page_indptr: DeviceTensor,
        kv_last_page_lens: DeviceTensor,
    ) -> DeviceTensor:
        heads = self.num_heads
        tokens = check_attention(q, expect(pool, "float32", 6, "attention", "pool"), heads)
        _, _, _, page_size, kv_heads, head_dim = pool.shape
        if head_dim > configs.MAX_HEAD_DIM:
            raise ValueError(f"attention: head_dim {head_dim} exceeds {configs.MAX_HEAD_DIM}")
        batch = check_page_tables(qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)
        rt = self.rt
        work = rt.pass_work
        if work is None:
            # A launch of its own: its tables, read on the host, are checked (a page outside the pool would be
            # read unbounded) and planned from.
            host_qo_indptr, *tables = map(rt.host_view, (qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens))
            lengths = check_page_table_values("attention", host_qo_indptr, *tables, page_size, rows=tokens,
                                              num_pages=pool.shape[1])
            work = PassWork(host_qo_indptr, *lengths, rt.upload)
        out = rt.empty((tokens, heads * head_dim))
        if not tokens:
            return out
        a = self.args
        a.q, a.pool, a.out = q.ptr, pool.ptr + pool_layer("attention", pool, self.layer)[0], out.ptr
        a.qo_indptr, a.page_indices, a.page_indptr, a.last_lens = (
            qo_indptr.ptr, kv_page_indices.ptr, kv_page_indptr.ptr, kv_last_page_lens.ptr)
        a.batch, a.kv_heads, a.head_dim, a.page_size = batch, kv_heads, head_dim, page_size
        variant = self.variant
        if variant == "decode":
            self._decode(*configs.attention_per_token(tokens, heads))
        elif variant == "prefill":
            block_q, block_k, shared = configs.prefill_tiles(head_dim)
            items = work.query_tiles(block_q)
            a.items, a.block_q, a.block_k = items.ptr, block_q, block_k
            self._prefill(*configs.attention_items(items.shape[0], heads, shared))
        else:
            items, item_ptr = work.key_chunks(SPLIT_CHUNK, self.window)
            partial = rt.empty((items.shape[0], heads, head_dim + 2))
            a.items, a.item_ptr, a.partial = items.ptr, item_ptr.ptr, partial.ptr
            self._split(*configs.attention_items(items.shape[0], heads))
            self._merge(*configs.attention_per_token(tokens, heads))
        return out


def make_attention(rt: GpuDevice, request: KernelRequest) -> Launcher:
    return Attention(rt, str(request.variant), *attention_request(request))


# ---------------------------------------------------------------------------------------------
# Projections
# ---------------------------------------------------------------------------------------------


class Projection:
    """One GEMM family launch: linear, rms_norm_linear, linear_add, rms_norm_gate_up_silu.

    With a norm, the kernel scales x by the norm weight while loading it and sums
    each row's squares on the way; the row's 1 / rms multiplies its dot products
    at the end (it factors out of them). No extra launch, and the normalized
    activations never reach memory.
    """

    KERNEL_NAMES: ClassVar[dict[str, str]] = {"gemv": "pie_gemv", "tiled": "pie_gemm", "tc": "pie_gemm_tc"}

    def __init__(self, rt: GpuDevice, name: str, variant: str, eps: float | None = None):
        if variant == "tc" and not rt.facts.tensor_cores:
            raise ValueError(f"the tensor-core GEMM needs sm_80 or newer, not {rt.facts.architecture}")
        self.rt = rt
        self.name = name
        self.variant = variant
        self.paired = paired = name == "rms_norm_gate_up_silu"
        self.args = STRUCTS["GemmArgs"]()
        self.args.paired = int(paired)
        self.args.eps = 0.0 if eps is None else eps
        self._bound: dict[tuple[str, str], BoundLaunch] = {}
        self._plans: dict[tuple[int, int, int, str], tuple[BoundLaunch, LaunchConfig]] = {}

    def _launch_for(self, impl: str, dtype: str) -> BoundLaunch:
        launch = self._bound.get((impl, dtype))
        if launch is None:
            name = f"{self.KERNEL_NAMES[impl]}_{WEIGHT_SUFFIX[dtype]}"
            launch = self._bound[(impl, dtype)] = self.rt.bind("gemm", name, self.args)
        return launch

    def _plan(self, rows: int, out_cols: int, k: int, dtype: str) -> tuple[BoundLaunch, LaunchConfig]:
        """The kernel and grid for ``rows`` rows and ``out_cols`` outputs of a weight [n, k] of type ``dtype``.
        Block-quantized weights have no tensor-core kernel: ``tc`` runs them on the tiled GEMM."""
        rt = self.rt
        impl = self.variant
        if impl == "tc" and dtype in BLOCK_DTYPES:
            impl = "tiled"
        if impl == "gemv":
            config = configs.gemv(out_cols, rows, rt.facts.warp_size)
        else:
            config = configs.gemm(out_cols, rows, self.paired, impl == "tc")
            if impl == "tc":
                splits = configs.gemm_splits(config.grid_x * config.grid_y, k, rt.facts.multiprocessors)
                config = config._replace(grid_z=splits)
        return self._launch_for(impl, dtype), config

    def run(
        self,
        x: DeviceTensor,
        weight: DeviceTensor,
        bias: DeviceTensor | None = None,
        residual: DeviceTensor | None = None,
        norm_weight: DeviceTensor | None = None,
    ) -> DeviceTensor:
        rt = self.rt
        if weight.dtype == "float32" and rt.weight_dtype != "float32":
            rt.convert_weight(weight, rt.weight_dtype)
        rows, k, out_cols = check_projection(self.name, x, weight, bias, residual, norm_weight)
        n = weight.shape[0]
        out = rt.empty((rows, out_cols))
        if not rows or not out_cols:
            return out
        key = (rows, n, k, weight.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(rows, out_cols, k, weight.dtype)
            if rows <= PLANNED_ROWS:
                self._plans[key] = plan
        launch, config = plan
        a = self.args
        a.x, a.w, a.bias, a.residual, a.out = x.ptr, weight.ptr, _ptr(bias), _ptr(residual), out.ptr
        a.norm_w = _ptr(norm_weight)
        a.rows, a.n, a.k = rows, n, k
        if config.grid_z > 1:
            tiles = config.grid_x * config.grid_y
            partial = rt.empty((tiles * config.grid_z, configs.SPLIT_SLOT_FLOATS))
            a.partial, a.arrivals = partial.ptr, rt.arrivals(tiles)
        else:
            a.partial = a.arrivals = 0
        launch(*config)
        return out


def make_projection(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """``linear``, ``rms_norm_linear``, ``linear_add`` or ``rms_norm_gate_up_silu``, each taking the
    catalogue's arguments in its order."""
    name, variant, eps = request.name, str(request.variant), request.option("eps")
    run = Projection(rt, name, variant, None if eps is None else float(eps)).run
    return projection_launcher(name, run)


# ---------------------------------------------------------------------------------------------
# The table the plugin serves from
# ---------------------------------------------------------------------------------------------

KERNELS: dict[str, tuple[tuple[str, ...], Factory]] = {
    "embedding": (("gather",), make_embedding),
    "rms_norm": (("block",), make_row_kernel),
    "rms_norm_heads": (("block",), make_row_kernel),
    "linear": (PROJECTION_VARIANTS, make_projection),
    "add": (("elementwise",), make_add),
    "slice_columns": (("elementwise",), make_slice_columns),
    "silu_mul": (("elementwise",), make_silu_mul),
    "rope": (("rotate_half",), make_rope),
    "append_kv": (("scatter",), make_append_kv),
    "attention": (ATTENTION_VARIANTS, make_attention),
    "gather_rows": (("gather",), make_gather_rows),
    "argmax": (("block",), make_row_kernel),
    "softmax": (("block",), make_row_kernel),
    "top_k": (("block",), make_top_k),
    "epilogue": (("eta",), make_epilogue),
    "rms_norm_linear": (PROJECTION_VARIANTS, make_projection),
    "linear_add": (PROJECTION_VARIANTS, make_projection),
    "rms_norm_gate_up_silu": (PROJECTION_VARIANTS, make_projection),
}

UNIT_OF_KERNEL = {
    name: "gemm" if variants is PROJECTION_VARIANTS else "attention" if name == "attention" else "core"
    for name, (variants, _) in KERNELS.items()
    if name != "epilogue"
}
"""The compile unit of each kernel; an epilogue is its own module, generated from its eta program."""

def kernel_listing(tensor_cores: bool) -> dict[str, tuple[str, ...]]:
    """Kernels and variants for a device, the default first; the tensor-core GEMM only where mma.sync
    exists, else the tiled GEMM is the projections' default."""
    listing = {}
    for name, (variants, _) in KERNELS.items():
        if variants is PROJECTION_VARIANTS and not tensor_cores:
            variants = ("tiled", *(v for v in variants if v not in ("tc", "tiled")))
        listing[name] = variants
    return listing
