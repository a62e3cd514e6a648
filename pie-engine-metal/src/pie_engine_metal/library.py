"""The MSL kernel set: which function lives in which ``.metal`` file and how it is bound.

The host binds every function the same way: its buffers at ``[[buffer(0)]]`` upwards
in the order listed here, then a struct of ``uint`` shape fields (``params``) with
``setBytes`` at the next index. Compile-time options are Metal function constants,
fixed when a pipeline is built. The tests parse the ``.metal`` sources and check this
table against every kernel signature, so the two cannot drift apart. ``weights.metal``
(reading weights in their stored types) is prepended to the libraries that read weights.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

ConstantKind = Literal["bool", "uint", "float"]


@dataclass(frozen=True)
class Constant:
    """A function constant: ``constant <kind> <name> [[function_constant(index)]];``."""

    index: int
    name: str
    kind: ConstantKind


@dataclass(frozen=True)
class Function:
    library: str
    """The ``.metal`` file (without suffix) that defines the kernel."""
    name: str
    buffers: tuple[str, ...]
    """Argument names at ``[[buffer(0)]]``, ``[[buffer(1)]]``..."""
    params: tuple[str, ...]
    """Fields of the ``uint`` struct bound right after the buffers."""
    constants: tuple[str, ...] = ()
    collective: bool = False
    """Uses threadgroup barriers or simdgroup functions."""

    @property
    def params_index(self) -> int:
        return len(self.buffers)

    def pack(self, *values: int) -> bytes:
        """The params struct, little-endian ``uint`` fields in declaration order."""
        if len(values) != len(self.params):
            raise ValueError(
                f"{self.name} takes {len(self.params)} params ({', '.join(self.params)}), got {len(values)}"
            )
        return struct.pack(f"<{len(values)}I", *values)


def _constants(*declared: tuple[str, ConstantKind]) -> dict[str, Constant]:
    """A library's function constants, at indices 0, 1... in the order given."""
    return {name: Constant(index, name, kind) for index, (name, kind) in enumerate(declared)}


CONSTANTS: dict[str, dict[str, Constant]] = {
    "elementwise": _constants(("slice_start", "uint"), ("rope_head_dim", "uint"), ("table_type", "uint")),
    "rows": _constants(("eps", "float"), ("temperature", "float")),
    "linear": _constants(
        ("has_bias", "bool"), ("has_norm", "bool"), ("gated", "bool"), ("has_residual", "bool"), ("weight_type", "uint")
    ),
    "attention": _constants(("scale", "float"), ("window", "uint"), ("softcap", "float")),
}

_LINEAR_BUFFERS = ("x", "weight", "bias", "norm_weight", "inverse_rms", "residual", "out")
_LINEAR_CONSTANTS = tuple(CONSTANTS["linear"])
_ATTENTION_BUFFERS = ("q", "pool", "qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens", "out")
_ATTENTION_PARAMS = ("tokens", "num_seqs", "num_heads", "num_kv_heads", "head_dim", "page_size", "num_pages")

FUNCTIONS: dict[str, Function] = {
    f.name: f
    for f in (
        Function("elementwise", "embedding", ("ids", "table", "out"), ("tokens", "dim", "vocab"), ("table_type",)),
        Function("elementwise", "add", ("a", "b", "out"), ("count",)),
        Function("elementwise", "slice_columns", ("x", "out"), ("rows", "in_cols", "out_cols"), ("slice_start",)),
        Function("elementwise", "silu_mul", ("gate_up", "out"), ("rows", "cols")),
        Function("elementwise", "rope", ("x", "positions", "inv_freq", "out"), ("tokens", "heads"), ("rope_head_dim",)),
        Function(
            "elementwise", "append_kv", ("pool", "k", "v", "slots"), ("tokens", "width", "page_size", "num_pages")
        ),
        Function("elementwise", "gather_rows", ("x", "rows", "out"), ("rows", "cols", "source_rows")),
        Function("rows", "rms_norm", ("x", "weight", "out"), ("rows", "cols"), ("eps",), collective=True),
        Function("rows", "inverse_rms", ("x", "out"), ("rows", "cols"), ("eps",), collective=True),
        Function("rows", "softmax", ("x", "out"), ("rows", "cols"), ("temperature",), collective=True),
        Function("rows", "argmax", ("x", "out"), ("rows", "cols"), collective=True),
        *(
            Function(
                "linear", name, _LINEAR_BUFFERS, ("tokens", "in_features", "out_features"), _LINEAR_CONSTANTS, True
            )
            for name in ("linear_gemv", "linear_tiled", "linear_simdgroup")
        ),
        *(
            Function("attention", name, _ATTENTION_BUFFERS, _ATTENTION_PARAMS, ("scale", "window", "softcap"), True)
            for name in ("attention_decode", "attention_prefill")
        ),
    )
}


READS_WEIGHTS = ("linear", "elementwise")
"""The libraries compiled with ``weights.metal`` in front."""


def _read(name: str) -> str:
    return (resources.files("pie_engine_metal") / "kernels" / f"{name}.metal").read_text(encoding="utf-8")


@cache
def source(library: str) -> str:
    """The MSL text of one library: its ``.metal`` file, after ``weights.metal`` where it reads weights."""
    if library not in CONSTANTS:
        raise KeyError(f"no MSL library {library!r} (have {', '.join(CONSTANTS)})")
    return (_read("weights") + "\n" if library in READS_WEIGHTS else "") + _read(library)


def constant_values(
    function: Function, values: dict[str, bool | int | float]
) -> tuple[tuple[Constant, bool | int | float], ...]:
    """Every constant ``function`` reads, with its value, in index order; a missing one is an error."""
    table = CONSTANTS[function.library]
    missing = [name for name in function.constants if name not in values]
    extra = [name for name in values if name not in function.constants]
    if missing or extra:
        raise ValueError(f"{function.name}: constants missing {missing}, unknown {extra}")
    return tuple(sorted(((table[name], values[name]) for name in function.constants), key=lambda item: item[0].index))
