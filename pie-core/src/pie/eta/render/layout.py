"""How an engine binds and launches a rendered epilogue: the same for every target.

Buffers come first, inputs then outputs in declaration order, at slots 0..n-1 (kernel
argument order for CUDA/HIP/OpenCL, `[[buffer(i)]]` for Metal, `@binding(i)` in group 0
for WGSL). The sizes and all params follow in one struct at slot n (passed by value for
CUDA/HIP/OpenCL, a constant buffer for Metal, a uniform buffer for WGSL). Every struct
field is 4 bytes: `rows`, `cols`, then each param in declaration order.

Launch `groups(rows, cols)` workgroups of `workgroup_size` threads (x only). Workgroup
number `y * groups_x + x` takes one row when `per_row` (row reductions), else the next
`workgroup_size` elements, one per thread; the grid is 2-D only because WebGPU caps each
dimension at 65535. Outputs may alias full inputs (in place) on every target but WGSL,
whose bind groups forbid a buffer that is both read-only and writable.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..ir import Reduce, postorder
from ..types import DType

if TYPE_CHECKING:
    from ..epilogue import Epilogue

WORKGROUP_SIZE = 256  # threads per workgroup/block; row reductions assume a power of two
MAX_GROUPS_X = 65535  # WebGPU's default per-dimension dispatch limit: larger grids use y too
MAX_ELEMENTS = 2**31 - 1  # indices are 32-bit; rows * cols must stay below this

_FIELD_FORMATS = {"u32": "I", "f32": "f", "i32": "i"}


@dataclass(frozen=True)
class BufferBinding:
    slot: int
    name: str
    role: str  # 'input' | 'output'
    dtype: DType  # f32 or i32 elements
    shape: str  # 'rows,cols' | 'cols' | 'rows'


@dataclass(frozen=True)
class ParamField:
    name: str  # 'rows', 'cols' or a declared param
    dtype: DType | None  # the param's declared type; None for the sizes
    storage: str  # 'u32' | 'f32' | 'i32': f16/bf16 travel as f32, bool as u32 (0 or 1)
    offset: int  # bytes from the start of the struct


@dataclass(frozen=True)
class BindingLayout:
    buffers: tuple[BufferBinding, ...]
    fields: tuple[ParamField, ...]
    params_slot: int
    params_size: int  # bytes, padded to 16 for uniform buffers
    workgroup_size: int
    per_row: bool  # True: one workgroup per row (row reductions); False: one thread per element

    def pack_params(self, rows: int, cols: int, /, **params: Any) -> bytes:
        """The params struct as little-endian bytes. The sizes are positional-only, so that a param may
        have any eta name (`self` included) without colliding with this method's own parameters."""
        if rows * cols > MAX_ELEMENTS:
            raise ValueError(f"rows * cols = {rows * cols} exceeds {MAX_ELEMENTS}")
        values = {"rows": rows, "cols": cols, **params}
        names = {f.name for f in self.fields}
        if set(values) != names:
            raise TypeError(f"params are {sorted(names - {'rows', 'cols'})}, got {sorted(params)}")
        data = bytearray(self.params_size)
        for field in self.fields:
            value = values[field.name]
            value = int(bool(value)) if field.dtype is DType.BOOL else value
            struct.pack_into("<" + _FIELD_FORMATS[field.storage], data, field.offset, value)
        return bytes(data)

    def groups(self, rows: int, cols: int) -> tuple[int, int]:
        """The grid of workgroups (blocks) to launch, `(x, y)`."""
        work = max(1, rows if self.per_row else math.ceil(rows * cols / self.workgroup_size))
        x = min(work, MAX_GROUPS_X)
        return x, math.ceil(work / x)


def layout_of(epilogue: Epilogue) -> BindingLayout:
    buffers = [BufferBinding(slot, i.name, "input", i.dtype, i.shape.value) for slot, i in enumerate(epilogue.inputs)]
    buffers += [
        BufferBinding(len(buffers) + k, o.name, "output", o.dtype, "rows,cols") for k, o in enumerate(epilogue.outputs)
    ]
    fields = [ParamField("rows", None, "u32", 0), ParamField("cols", None, "u32", 4)]
    for k, p in enumerate(epilogue.params):
        storage = "f32" if p.dtype.is_float else "u32" if p.dtype is DType.BOOL else "i32"
        fields.append(ParamField(p.name, p.dtype, storage, 8 + 4 * k))
    size = 4 * len(fields)
    per_row = any(isinstance(n, Reduce) for n in postorder(o.value for o in epilogue.outputs))
    return BindingLayout(tuple(buffers), tuple(fields), len(buffers), -(-size // 16) * 16, WORKGROUP_SIZE, per_row)
