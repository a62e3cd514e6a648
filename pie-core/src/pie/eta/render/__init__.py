"""Render epilogues to kernel source for GPU and CPU compute languages."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .c_style import CStyleRenderer
from .languages import HipRenderer, MetalRenderer, OpenCLRenderer
from .layout import BindingLayout, BufferBinding, ParamField, layout_of
from .slang import SlangRenderer
from .wgsl import WgslRenderer

if TYPE_CHECKING:
    from ..epilogue import Epilogue

RENDERERS: dict[str, type[CStyleRenderer]] = {
    "cuda": CStyleRenderer,
    "hip": HipRenderer,
    "metal": MetalRenderer,
    "wgsl": WgslRenderer,
    "opencl": OpenCLRenderer,
    "slang": SlangRenderer,
}
TARGETS = tuple(RENDERERS)


@dataclass(frozen=True)
class RenderedKernel:
    target: str
    source: str  # the whole module: compile it, then look up `entry_point`
    entry_point: str
    sha256: str  # of `source`: a key for compile caches
    bindings: BindingLayout


def render_many(epilogues: Sequence[Epilogue], target: str) -> tuple[RenderedKernel, ...]:
    """One module for `target` holding a kernel per epilogue (duplicates share one).

    Compiling many epilogues as one module pays a compiler's fixed cost once.
    """
    if target not in RENDERERS:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    unique = list({ep.key: ep for ep in epilogues}.values())
    source = RENDERERS[target]().module(unique)
    digest = hashlib.sha256(source.encode()).hexdigest()
    return tuple(RenderedKernel(target, source, ep.entry_point, digest, layout_of(ep)) for ep in epilogues)


__all__ = ["TARGETS", "BindingLayout", "BufferBinding", "ParamField", "RenderedKernel", "render_many"]
