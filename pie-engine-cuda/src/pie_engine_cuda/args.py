"""ctypes mirrors of the kernel argument structs in ``csrc/args.cuh``.

A kernel takes one struct by value; a launcher keeps one instance, rewrites its
pointer fields per launch and passes its address. :func:`layout_asserts` turns
each mirror into ``static_assert``s appended to every compile unit, so a struct
edited on one side only fails to compile instead of scrambling arguments.
"""

from __future__ import annotations

import ctypes

_PTR = ctypes.c_uint64
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float


class BinaryArgs(ctypes.Structure):
    _fields_ = [("a", _PTR), ("b", _PTR), ("out", _PTR), ("n", _I64)]


class SiluMulArgs(ctypes.Structure):
    _fields_ = [("x", _PTR), ("out", _PTR), ("n", _I64), ("half", _I32)]


class SliceArgs(ctypes.Structure):
    _fields_ = [("x", _PTR), ("out", _PTR), ("n", _I64), ("width", _I32), ("start", _I32), ("count", _I32)]


class GatherArgs(ctypes.Structure):
    _fields_ = [("rows", _PTR), ("table", _PTR), ("out", _PTR), ("n", _I64), ("cols", _I32), ("table_rows", _I32)]


class RmsArgs(ctypes.Structure):
    _fields_ = [
        ("x", _PTR),
        ("weight", _PTR),
        ("out", _PTR),
        ("rows", _I32),
        ("cols", _I32),
        ("eps", _F32),
    ]


class RopeArgs(ctypes.Structure):
    _fields_ = [
        ("x", _PTR),
        ("positions", _PTR),
        ("inv_freq", _PTR),
        ("out", _PTR),
        ("tokens", _I32),
        ("heads", _I32),
        ("head_dim", _I32),
    ]


class QkvRopeArgs(ctypes.Structure):
    _fields_ = [
        ("qkv", _PTR),
        ("positions", _PTR),
        ("inv_freq", _PTR),
        ("q", _PTR),
        ("k", _PTR),
        ("v", _PTR),
        ("tokens", _I32),
        ("q_width", _I32),
        ("kv_width", _I32),
        ("head_dim", _I32),
    ]


class AppendKvArgs(ctypes.Structure):
    _fields_ = [
        ("pool", _PTR),
        ("k", _PTR),
        ("v", _PTR),
        ("slots", _PTR),
        ("tokens", _I32),
        ("width", _I32),
        ("page_size", _I32),
    ]


class ArgmaxArgs(ctypes.Structure):
    _fields_ = [("x", _PTR), ("out", _PTR), ("rows", _I32), ("cols", _I32)]


class SoftmaxArgs(ctypes.Structure):
    _fields_ = [("x", _PTR), ("out", _PTR), ("rows", _I32), ("cols", _I32), ("temperature", _F32)]


class TopKArgs(ctypes.Structure):
    _fields_ = [
        ("x", _PTR),
        ("values", _PTR),
        ("indices", _PTR),
        ("rows", _I32),
        ("cols", _I32),
        ("k", _I32),
        ("pad", _I32),
    ]


class PagesArgs(ctypes.Structure):
    _fields_ = [
        ("pool", _PTR),
        ("buffer", _PTR),
        ("page_ids", _PTR),
        ("page_elems", _I64),
        ("num_pages", _I32),
        ("count", _I32),
        ("first", _I32),
        ("to_pool", _I32),
    ]


class SweepArgs(ctypes.Structure):
    _fields_ = [("x", _PTR), ("sink", _PTR), ("count", _I64)]


class ConvertArgs(ctypes.Structure):
    _fields_ = [("src", _PTR), ("dst", _PTR), ("n", _I64)]


class GemmArgs(ctypes.Structure):
    _fields_ = [
        ("x", _PTR),
        ("w", _PTR),
        ("bias", _PTR),
        ("residual", _PTR),
        ("norm_w", _PTR),
        ("out", _PTR),
        ("partial", _PTR),
        ("arrivals", _PTR),
        ("rows", _I32),
        ("n", _I32),
        ("k", _I32),
        ("paired", _I32),
        ("eps", _F32),
    ]


class AttnArgs(ctypes.Structure):
    _fields_ = [
        ("q", _PTR),
        ("pool", _PTR),
        ("out", _PTR),
        ("partial", _PTR),
        ("qo_indptr", _PTR),
        ("page_indices", _PTR),
        ("page_indptr", _PTR),
        ("last_lens", _PTR),
        ("items", _PTR),
        ("item_ptr", _PTR),
        ("batch", _I32),
        ("num_heads", _I32),
        ("kv_heads", _I32),
        ("head_dim", _I32),
        ("page_size", _I32),
        ("block_q", _I32),
        ("block_k", _I32),
        ("scale", _F32),
        ("window", _I32),
        ("softcap", _F32),
    ]


ARG_STRUCTS: tuple[type[ctypes.Structure], ...] = (
    BinaryArgs,
    SiluMulArgs,
    SliceArgs,
    GatherArgs,
    RmsArgs,
    RopeArgs,
    QkvRopeArgs,
    SweepArgs,
    AppendKvArgs,
    ArgmaxArgs,
    SoftmaxArgs,
    TopKArgs,
    PagesArgs,
    ConvertArgs,
    GemmArgs,
    AttnArgs,
)


def layout_asserts(structs: tuple[type[ctypes.Structure], ...] = ARG_STRUCTS) -> str:
    """``static_assert``s that pin each C struct to its ctypes mirror (size, offsets, field sizes)."""
    lines = ["// Generated from pie_engine_cuda/args.py: the host's ctypes layout of every argument struct."]
    for struct in structs:
        name = struct.__name__
        lines.append(f'static_assert(sizeof({name}) == {ctypes.sizeof(struct)}, "{name}: size differs from args.py");')
        for field_name, *_ in struct._fields_:
            field = getattr(struct, field_name)
            lines.append(
                f"static_assert(PIE_OFFSETOF({name}, {field_name}) == {field.offset} && "
                f'sizeof((({name}*)0)->{field_name}) == {field.size}, "{name}.{field_name}: layout differs from args.py");'
            )
    return "\n".join(lines) + "\n"
