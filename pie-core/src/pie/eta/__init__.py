"""eta: a small, safe expression language for kernel epilogues.

An eta program declares its inputs, params and outputs and computes the outputs with
elementwise arithmetic, math functions, select and row reductions::

    in x: f32
    in weight: f32[cols]
    param eps: f32
    out y = x * rsqrt(row_mean(x * x) + eps) * weight

`compile` checks it into a typed IR; an `Epilogue` renders CUDA C, HIP, Metal, WGSL,
OpenCL C or Slang source, or runs with numpy or JAX. User text never reaches generated source:
identifiers are re-emitted from the IR behind prefixes and numbers are printed from their
parsed values.
"""

from __future__ import annotations

from .checker import check
from .epilogue import Epilogue
from .errors import EtaError, EtaSyntaxError, EtaTypeError
from .ir import Input, Output, Param
from .parser import parse
from .render import TARGETS, BindingLayout, BufferBinding, ParamField, RenderedKernel, render_many
from .types import DType, Shape


def compile(source: str) -> Epilogue:
    """Parse and type-check eta source; raises EtaSyntaxError or EtaTypeError."""
    return Epilogue(source, *check(parse(source), source))


__all__ = [
    "TARGETS",
    "BindingLayout",
    "BufferBinding",
    "DType",
    "Epilogue",
    "EtaError",
    "EtaSyntaxError",
    "EtaTypeError",
    "Input",
    "Output",
    "Param",
    "ParamField",
    "RenderedKernel",
    "Shape",
    "compile",
    "render_many",
]
