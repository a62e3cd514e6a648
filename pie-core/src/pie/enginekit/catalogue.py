"""The host side of catalogue kernels that every device engine's launchers decide the same way.

A launcher checks its arguments, sizes its outputs, then packs and dispatches a launch. What does not
depend on the device is here: how each projection's catalogue arguments map onto one launch of the
GEMM family (and embedding's onto gather_rows), attention's compile-time options, which bytes of a
page pool are one layer, an eta epilogue's program, checks and outputs, and the argument checks
that keep a kernel from reading or writing past a buffer (``check_*``: each raises a ValueError naming
the problem). What can be is bound once, when the kernel is compiled, so a launch does no more than
it did in each engine. The Slang launchers
(:mod:`pie.enginekit.shaders.launch`), the CUDA engine's and the Metal engine's use them; the CPU and XLA
engines put :func:`checked_launcher` in front of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial, wraps
from typing import Any, NamedTuple

from pie.contract import KernelRequest, Launcher
from pie.kernels import PROJECTIONS, attention_options

ProjectionRun = Callable[[Any, Any, Any, Any, Any], Any]
"""``run(x, weight, bias, residual, norm_weight)``: one launch of an engine's projection family, each
optional input None where the kernel has none."""


def projection_launcher(name: str, run: ProjectionRun) -> Launcher:
    """The launcher of projection ``name`` (``pie.kernels.PROJECTIONS``), taking the catalogue's arguments in
    their order, over ``run``."""
    if name == "linear":

        def linear(x: Any, weight: Any, bias: Any = None) -> Any:
            return run(x, weight, bias, None, None)

        return linear
    if name == "rms_norm_linear":

        def rms_norm_linear(x: Any, norm_weight: Any, weight: Any, bias: Any = None) -> Any:
            return run(x, weight, bias, None, norm_weight)

        return rms_norm_linear
    if name == "linear_add":

        def linear_add(x: Any, weight: Any, residual: Any) -> Any:
            return run(x, weight, None, residual, None)

        return linear_add
    if name == "rms_norm_gate_up_silu":

        def rms_norm_gate_up_silu(x: Any, norm_weight: Any, gate_up: Any) -> Any:
            return run(x, gate_up, None, None, norm_weight)

        return rms_norm_gate_up_silu
    raise ValueError(f"{name!r} is not a projection (one of {', '.join(PROJECTIONS)})")


def embedding_launcher(gather_rows: Launcher) -> Launcher:
    """``embedding(ids, table)`` over an engine's ``gather_rows(table, ids)``: the same rows, arguments swapped."""

    def embedding(ids: Any, table: Any) -> Any:
        return gather_rows(table, ids)

    return embedding


# -- argument checks ----------------------------------------------------------------------------
# They take any tensor with ``shape`` (a tuple) and ``dtype``: the kit's GpuTensor and numpy arrays hold a
# numpy dtype, the CUDA engine's DeviceTensor its name; ``dtype != "float32"`` reads both. A weight is
# checked by its logical ``shape`` only: it may be stored in another type. Nothing is allocated, and a
# message is made only when a check fails.

F32 = "float32"
I32 = "int32"


def expect(tensor: Any, dtype: str, ndim: int, kernel: str, argument: str) -> Any:
    """``tensor`` when it is a ``ndim``-d ``dtype`` tensor, else a ValueError naming the kernel and argument."""
    shape = getattr(tensor, "shape", None)
    if shape is None or len(shape) != ndim or getattr(tensor, "dtype", None) != dtype:
        got = f"{tuple(shape)} {tensor.dtype}" if shape is not None and hasattr(tensor, "dtype") else repr(tensor)
        raise ValueError(f"{kernel} {argument}: expected a {ndim}-d {dtype} tensor, got {got}")
    return tensor


def check_rows(kernel: str, x: Any) -> tuple[int, int]:
    """(rows, columns) of a float32 activation ``[rows, columns]``."""
    rows, columns = expect(x, F32, 2, kernel, "x").shape
    return rows, columns


def check_add(a: Any, b: Any) -> None:
    expect(a, F32, 2, "add", "a")
    if expect(b, F32, 2, "add", "b").shape != a.shape:
        raise ValueError(f"add: shapes {a.shape} and {b.shape} differ")


def check_slice_columns(x: Any, start: int, stop: int) -> int:
    """The rows of ``x [rows, width]`` whose columns ``start:stop`` are kept."""
    rows, width = check_rows("slice_columns", x)
    if not 0 <= start <= stop <= width:
        raise ValueError(f"slice_columns: [{start}:{stop}] is outside {width} columns")
    return rows


def check_silu_mul(gate_up: Any) -> tuple[int, int]:
    """(rows, half the width) of a ``[rows, 2 * half]`` gate/up activation."""
    rows, width = expect(gate_up, F32, 2, "silu_mul", "gate_up").shape
    if width % 2:
        raise ValueError(f"silu_mul: width {width} is odd")
    return rows, width // 2


def check_rope(x: Any, positions: Any, inv_freq: Any, head_dim: int) -> tuple[int, int]:
    """(tokens, heads) of rope over ``x [tokens, heads * head_dim]``, ``positions`` int32 ``[tokens]`` and
    ``inv_freq [head_dim / 2]``."""
    tokens, width = check_rows("rope", x)
    if head_dim <= 0 or head_dim % 2 or width % head_dim:
        raise ValueError(f"rope: width {width} is not whole heads of {head_dim}")
    if expect(positions, I32, 1, "rope", "positions").shape != (tokens,):
        raise ValueError(f"rope: positions {positions.shape} are not [{tokens}], one a token")
    if expect(inv_freq, F32, 1, "rope", "inv_freq").shape != (head_dim // 2,):
        raise ValueError(f"rope: inv_freq must be [{head_dim // 2}], got {inv_freq.shape}")
    return tokens, width // head_dim


def check_pool(kernel: str, pool: Any) -> tuple[int, ...]:
    """The shape of a page pool ``[layers, pages, 2, page_size, kv_heads, head_dim]`` (its element type is the
    engine's to check: each keeps its own)."""
    shape = tuple(pool.shape)
    if len(shape) != 6 or shape[2] != 2:
        raise ValueError(f"{kernel}: {shape} is not a page pool [layers, pages, 2, page_size, kv_heads, head_dim]")
    return shape


def check_append_kv(pool: Any, k: Any, v: Any, slots: Any) -> int:
    """The tokens whose ``k`` and ``v`` (``[tokens, kv_heads * head_dim]`` of ``pool``) go to ``slots`` (int32
    ``[tokens]``)."""
    width = math.prod(check_pool("append_kv", pool)[4:])
    expect(k, F32, 2, "append_kv", "k")
    expect(v, F32, 2, "append_kv", "v")
    if expect(slots, I32, 1, "append_kv", "slots").shape[0] != k.shape[0] or k.shape[1] != width or v.shape != k.shape:
        raise ValueError(f"append_kv: k {k.shape}, v {v.shape}, slots {slots.shape} are not [tokens, {width}] "
                         "and [tokens]")
    return int(k.shape[0])


def check_top_k(x: Any, k: int) -> tuple[int, int]:
    """(rows, columns) of top_k's ``x``, each row at least ``k`` long."""
    rows, columns = check_rows("top_k", x)
    if not 0 < k <= columns:
        raise ValueError(f"top_k: k={k} must be in 1..{columns} (the row's length)")
    return rows, columns


def check_indices(kernel: str, indices: Any) -> int:
    """How many rows an int32 ``[n]`` index vector of ``kernel`` picks."""
    return int(expect(indices, I32, 1, kernel, "indices").shape[0])


def check_matrix(kernel: str, argument: str, matrix: Any) -> tuple[int, int]:
    """(rows, columns) of a weight or a table rows are gathered from, of any element type (float32, or a weight
    in its stored type, whose ``shape`` is its logical one)."""
    if len(matrix.shape) != 2:
        raise ValueError(f"{kernel}: the {argument} {tuple(matrix.shape)} is not [rows, columns]")
    rows, columns = matrix.shape
    return rows, columns


def check_heads(kernel: str, x: Any, head_dim: int) -> int:
    """How many heads of ``head_dim`` values each row of a ``[rows, heads * head_dim]`` activation holds."""
    width = x.shape[1]
    if head_dim <= 0 or width % head_dim:
        raise ValueError(f"{kernel}: width {width} is not whole heads of {head_dim}")
    return width // head_dim


def check_norm_weight(kernel: str, weight: Any, columns: int) -> None:
    """A norm's weight is one float32 value a column of the rows it scales."""
    if weight is None or weight.shape != (columns,):
        raise ValueError(f"{kernel}: weight {getattr(weight, 'shape', None)} is not [{columns}]")
    expect(weight, F32, 1, kernel, "weight")


def check_projection(
    kernel: str, x: Any, weight: Any, bias: Any, residual: Any, norm_weight: Any
) -> tuple[int, int, int]:
    """(tokens, k, outputs) of projection ``kernel`` (``pie.kernels.PROJECTIONS``) of ``x [tokens, k]`` by
    ``weight [rows, k]``: the bias holds one value a weight row and the norm weight one an input column, the
    residual is as big as the output, and the stacked gate/up weight of ``rms_norm_gate_up_silu`` has an even
    number of rows (its outputs are half of them). Each optional input is None where the kernel has none."""
    tokens, k = check_rows(kernel, x)
    rows, weight_columns = check_matrix(kernel, "weight", weight)
    if weight_columns != k:
        raise ValueError(f"{kernel}: x {tuple(x.shape)} has {k} columns, the weight {tuple(weight.shape)} "
                         f"takes {weight_columns}")
    outputs = rows
    if kernel == "rms_norm_gate_up_silu":
        if rows % 2:
            raise ValueError(f"{kernel}: the stacked gate/up weight has an odd number of rows ({rows})")
        outputs = rows // 2
    if bias is not None and expect(bias, F32, 1, kernel, "bias").shape != (rows,):
        raise ValueError(f"{kernel}: bias {bias.shape} for {rows} rows")
    if norm_weight is not None and expect(norm_weight, F32, 1, kernel, "norm weight").shape != (k,):
        raise ValueError(f"{kernel}: norm weight {norm_weight.shape} for {k} columns")
    if residual is not None and expect(residual, F32, 2, kernel, "residual").shape != (tokens, outputs):
        raise ValueError(f"{kernel}: residual {residual.shape} mismatches the output {(tokens, outputs)}")
    return tokens, k, outputs


def check_attention(q: Any, pool: Any, num_heads: int) -> int:
    """The tokens of attention's ``q [tokens, num_heads * head_dim]`` over ``pool``, whose KV heads group the
    ``num_heads`` query heads."""
    kv_heads, head_dim = check_pool("attention", pool)[4:]
    tokens, width = expect(q, F32, 2, "attention", "q").shape
    if width != num_heads * head_dim or num_heads % kv_heads:
        raise ValueError(f"attention: q {tuple(q.shape)} is not [tokens, {num_heads} heads * {head_dim}] "
                         f"over {kv_heads} KV heads")
    return int(tokens)


def check_layer(kernel: str, pool: Any, layer: int) -> None:
    """``layer`` (a compile-time option) is one of the layers of ``pool``, whose first axis they are."""
    layers = pool.shape[0]
    if not 0 <= layer < layers:
        raise ValueError(f"{kernel}: the page pool {tuple(pool.shape)} has no layer {layer} (it has {layers})")


def check_page_tables(qo_indptr: Any, kv_page_indices: Any, kv_page_indptr: Any, kv_last_page_lens: Any) -> int:
    """The batch of attention's page tables: int32 vectors, ``qo_indptr`` and ``kv_page_indptr`` one longer
    than ``kv_last_page_lens``."""
    tables = (qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)
    for table, name in zip(tables, ("qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")):
        expect(table, I32, 1, "attention", name)
    batch = qo_indptr.shape[0] - 1
    if kv_page_indptr.shape[0] != batch + 1:
        raise ValueError("attention: kv_page_indptr and qo_indptr describe different batches")
    if kv_last_page_lens.shape[0] != batch:
        raise ValueError("attention: kv_last_page_lens does not match the batch")
    return batch


def argument_check(request: KernelRequest) -> Callable[..., Any] | None:
    """The checks above for one launch of catalogue kernel ``request`` (its options fixed now), taking the
    kernel's arguments: for launchers that do not make them as they go (the CPU and XLA engines'). None for
    ``epilogue``, whose eta program checks its own inputs."""
    name, option = request.name, request.option
    if name in PROJECTIONS:
        return projection_launcher(name, partial(check_projection, name))
    if name in ("rms_norm", "rms_norm_heads"):
        head_dim = int(option("head_dim")) if name == "rms_norm_heads" else None

        def norm(x: Any, weight: Any) -> None:
            columns = check_rows(name, x)[1]
            if head_dim is not None:
                check_heads(name, x, head_dim)
                columns = head_dim
            check_norm_weight(name, weight, columns)

        return norm
    if name == "slice_columns":
        start, stop = int(option("start")), int(option("stop"))
        return lambda x: check_slice_columns(x, start, stop)
    if name == "rope":
        head_dim = int(option("head_dim"))
        return lambda x, positions, inv_freq: check_rope(x, positions, inv_freq, head_dim)
    if name == "top_k":
        k = int(option("k"))
        return lambda x: check_top_k(x, k)
    if name == "attention":
        num_heads, layer = int(option("num_heads")), int(option("layer"))

        def attention(q: Any, pool: Any, *tables: Any) -> None:
            check_attention(q, pool, num_heads)
            check_layer(name, pool, layer)
            check_page_tables(*tables)

        return attention
    if name == "append_kv":
        layer = int(option("layer"))

        def append_kv(pool: Any, k: Any, v: Any, slots: Any) -> None:
            check_append_kv(pool, k, v, slots)
            check_layer(name, pool, layer)

        return append_kv
    if name in ("embedding", "gather_rows"):

        def gather(table: Any, indices: Any) -> None:
            check_matrix(name, "table", table)
            check_indices(name, indices)

        return gather if name == "gather_rows" else lambda ids, table: gather(table, ids)
    checks: dict[str, Callable[..., Any]] = {
        "add": check_add,
        "silu_mul": check_silu_mul,
        "argmax": partial(check_rows, "argmax"),
        "softmax": partial(check_rows, "softmax"),
    }
    return checks.get(name)


def checked_launcher(request: KernelRequest, launcher: Launcher) -> Launcher:
    """``launcher`` behind :func:`argument_check` of ``request`` (the check made once, here): a launch calls
    the check, then the launcher, with the same arguments. ``launcher`` itself where there is no check."""
    check = argument_check(request)
    if check is None:
        return launcher

    @wraps(launcher)
    def checked(*args: Any) -> Any:
        check(*args)
        return launcher(*args)

    return checked


class AttentionOptions(NamedTuple):
    """An ``attention`` request's compile-time options; ``window`` 0 and ``softcap`` 0.0 turn theirs off."""

    layer: int
    num_heads: int
    scale: float
    window: int
    softcap: float


def attention_request(request: KernelRequest) -> AttentionOptions:
    window, softcap = attention_options(request.option("window"), request.option("softcap"))
    layer, num_heads = int(request.option("layer")), int(request.option("num_heads"))
    return AttentionOptions(layer, num_heads, float(request.option("scale")), window, softcap)


def pool_layer(kernel: str, pool: Any, layer: int) -> tuple[int, int]:
    """(byte offset, byte size) of layer ``layer`` of a page pool ``[layers, pages, 2, page_size, heads, dim]``
    (any tensor with ``shape`` and ``nbytes``) that ``kernel`` reads or writes; a layer the pool does not have
    is refused (:func:`check_layer`)."""
    check_layer(kernel, pool, layer)
    layer_bytes = pool.nbytes // pool.shape[0]
    return layer * layer_bytes, layer_bytes


ETA_DTYPES = {"f32": "float32", "i32": "int32"}
"""The tensor dtype of each eta element type."""


class EpilogueProgram:
    """An ``epilogue`` request's eta program rendered for one target, its params fixed: what a device launch
    of it needs besides the dispatch."""

    def __init__(self, request: KernelRequest, target: str):
        from pie import eta
        from pie.eta.types import Shape

        self.program = program = eta.compile(str(request.option("source")))
        self.rendered = program.render(target)
        self.layout = self.rendered.bindings
        self.params = dict(request.option("params", ()))
        self._inputs = [(spec.name, ETA_DTYPES[spec.dtype.value]) for spec in program.inputs]
        self._outputs = [ETA_DTYPES[spec.dtype.value] for spec in program.outputs]
        columns = {slot for slot, spec in enumerate(program.inputs) if spec.shape is Shape.COLS}
        slots = range(len(program.inputs) + len(program.outputs))
        self.row_slots = tuple(slot for slot in slots if slot not in columns)
        """The slots (inputs, then outputs) of the tensors with a row a launch row: all but the inputs of one element
        a column."""

    def outputs(self, inputs: Sequence[Any], empty: Callable[..., Any]) -> tuple[int, int, list[Any]]:
        """``(rows, cols, outputs)`` of a launch over ``inputs`` (in declared order), whose shapes and dtypes are
        checked; ``outputs`` are fresh tensors from ``empty(shape, dtype name)``, in declared order."""
        rows, cols = self.program.launch_shape([tensor.shape for tensor in inputs])
        for (name, dtype), tensor in zip(self._inputs, inputs):
            if tensor.dtype != dtype:
                raise ValueError(f"epilogue input {name!r} is {tensor.dtype}, not {dtype}")
        return rows, cols, [empty((rows, cols), dtype) for dtype in self._outputs]

    def packed_params(self, rows: int, cols: int) -> bytes:
        """The params block of a launch of ``rows`` x ``cols``."""
        return self.layout.pack_params(rows, cols, **self.params)
