"""The host side of catalogue kernels that every device engine's launchers decide the same way.

A launcher checks its arguments, sizes its outputs, then packs and dispatches a launch. What does not
depend on the device is here: how each projection's catalogue arguments map onto one launch of the
GEMM family (and embedding's onto gather_rows), attention's compile-time options, which bytes of a
page pool are one layer, an eta epilogue's program, checks and outputs, and the argument checks
that keep a kernel from reading or writing past a buffer (``check_*``: each raises a ValueError naming
the problem). What can be is bound once, when the kernel is compiled, so a launch does no more than
it did in each engine. The Slang launchers
(:mod:`pie.enginekit.shaders.launch`), the CUDA engine's and the Metal engine's use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
# They take any tensor with ``shape`` (a tuple) and ``dtype``: the kit's GpuTensor holds a numpy dtype,
# the CUDA engine's DeviceTensor its name; ``dtype != "int32"`` reads both. Nothing is allocated.


def check_add(a: Any, b: Any) -> None:
    if a.shape != b.shape:
        raise ValueError(f"add: shapes {a.shape} and {b.shape} differ")


def check_silu_mul(gate_up: Any) -> tuple[int, int]:
    """(rows, half the width) of a ``[rows, 2 * half]`` gate/up activation."""
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul: width {width} is odd")
    return rows, width // 2


def check_rope(x: Any, positions: Any, inv_freq: Any, head_dim: int) -> tuple[int, int]:
    """(tokens, heads) of rope over ``x [tokens, heads * head_dim]``, ``positions`` int32 ``[tokens]`` and
    ``inv_freq [head_dim / 2]``."""
    tokens, width = x.shape
    if head_dim <= 0 or head_dim % 2 or width % head_dim:
        raise ValueError(f"rope: width {width} is not whole heads of {head_dim}")
    if positions.shape != (tokens,) or positions.dtype != "int32":
        raise ValueError(f"rope: positions must be int32 [{tokens}], got {positions!r}")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"rope: inv_freq must be [{head_dim // 2}], got {inv_freq.shape}")
    return tokens, width // head_dim


def check_append_kv(k: Any, v: Any, slots: Any, width: int) -> None:
    """``k`` and ``v`` are ``[tokens, width]`` (``width`` = the pool's kv_heads * head_dim), ``slots`` int32
    ``[tokens]``."""
    if k.shape != (slots.shape[0], width) or v.shape != k.shape:
        raise ValueError(f"append_kv: k {k.shape}, v {v.shape}, slots {slots.shape} are not [tokens, {width}] "
                         "and [tokens]")
    if slots.dtype != "int32":
        raise ValueError(f"append_kv: slots must be int32, not {slots.dtype}")


def check_indices(kernel: str, indices: Any) -> int:
    """How many rows an int32 ``[n]`` index vector of ``kernel`` picks."""
    if len(indices.shape) != 1 or indices.dtype != "int32":
        raise ValueError(f"{kernel}: indices must be int32 [n], got {indices!r}")
    return int(indices.shape[0])


def check_norm_weight(kernel: str, weight: Any, columns: int) -> None:
    """A norm's weight is one value a column of the rows it scales."""
    if weight is None or weight.shape != (columns,):
        raise ValueError(f"{kernel}: weight {getattr(weight, 'shape', None)} is not [{columns}]")


def check_page_tables(qo_indptr: Any, kv_page_indices: Any, kv_page_indptr: Any, kv_last_page_lens: Any) -> int:
    """The batch of attention's page tables: int32 vectors, ``qo_indptr`` and ``kv_page_indptr`` one longer
    than ``kv_last_page_lens``."""
    for table in (qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens):
        if len(table.shape) != 1 or table.dtype != "int32":
            raise ValueError(f"attention: page tables must be int32 vectors, got {table!r}")
    batch = qo_indptr.shape[0] - 1
    if kv_page_indptr.shape[0] != batch + 1:
        raise ValueError("attention: kv_page_indptr and qo_indptr describe different batches")
    if kv_last_page_lens.shape[0] != batch:
        raise ValueError("attention: kv_last_page_lens does not match the batch")
    return batch


def check_bias_and_norm(kernel: str, bias: Any, norm_weight: Any, rows: int, k: int) -> None:
    """A projection's bias is one value a weight row (``rows``), its norm weight one an input column (``k``);
    None where it has none."""
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"{kernel}: bias {bias.shape} for {rows} rows")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"{kernel}: norm weight {norm_weight.shape} for {k} columns")


def check_residual(kernel: str, residual: Any, tokens: int, n: int) -> None:
    """A projection's residual (None: it has none) is as big as its output ``[tokens, n]``."""
    if residual is not None and residual.shape != (tokens, n):
        raise ValueError(f"{kernel}: residual {residual.shape} mismatches the output {(tokens, n)}")


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


def pool_layer(pool: Any, layer: int) -> tuple[int, int]:
    """(byte offset, byte size) of layer ``layer`` of a page pool ``[layers, pages, 2, page_size, heads, dim]``
    (any tensor with ``shape`` and ``nbytes``); a layer the pool does not have is refused."""
    layers = pool.shape[0]
    if not 0 <= layer < layers:
        raise ValueError(f"the page pool {tuple(pool.shape)} has no layer {layer} (it has {layers})")
    layer_bytes = pool.nbytes // layers
    return layer * layer_bytes, layer_bytes


ETA_DTYPES = {"f32": "float32", "i32": "int32"}
"""The tensor dtype of each eta element type."""


class EpilogueProgram:
    """An ``epilogue`` request's eta program rendered for one target, its params fixed: what a device launch
    of it needs besides the dispatch."""

    def __init__(self, request: KernelRequest, target: str):
        from pie import eta

        self.program = program = eta.compile(str(request.option("source")))
        self.rendered = program.render(target)
        self.layout = self.rendered.bindings
        self.params = dict(request.option("params", ()))
        self._inputs = [(spec.name, ETA_DTYPES[spec.dtype.value]) for spec in program.inputs]
        self._outputs = [ETA_DTYPES[spec.dtype.value] for spec in program.outputs]

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
