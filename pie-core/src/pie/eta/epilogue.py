"""`Epilogue`: a checked eta program, and what can be made from it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

from . import evaluate
from .ir import Input, Output, Param, describe, postorder
from .render import RenderedKernel, render_many
from .types import Shape


class Epilogue:
    """A compiled eta program: typed declarations and the IR of its outputs.

    Build one with `pie.eta.compile`. Two epilogues with the same IR have the same `key`
    (and entry point), however their source was spelled.
    """

    def __init__(
        self, source: str, inputs: tuple[Input, ...], params: tuple[Param, ...], outputs: tuple[Output, ...]
    ) -> None:
        self.source = source
        self.inputs = inputs
        self.params = params
        self.outputs = outputs

    def __repr__(self) -> str:
        inputs, outputs = (", ".join(d.name for d in group) for group in (self.inputs, self.outputs))
        return f"<Epilogue {self.entry_point}: {inputs} -> {outputs}>"

    @cached_property
    def ir_text(self) -> str:
        """The canonical text of the IR: declarations and numbered nodes."""
        lines = [f"in {i.name}: {i.dtype}[{i.shape}]" for i in self.inputs]
        lines += [f"param {p.name}: {p.dtype}" for p in self.params]
        names: dict[int, str] = {}
        for node in postorder(o.value for o in self.outputs):
            names[id(node)] = f"%{len(names)}"
            lines.append(f"{names[id(node)]} = {describe(node, names)}")
        lines += [f"out {o.name}: {o.dtype} = {names[id(o.value)]}" for o in self.outputs]
        return "\n".join(lines) + "\n"

    @cached_property
    def key(self) -> str:
        """sha256 of `ir_text`."""
        return hashlib.sha256(self.ir_text.encode()).hexdigest()

    @property
    def entry_point(self) -> str:
        return f"eta_{self.key[:16]}"

    def launch_shape(self, shapes: Sequence[tuple[int, ...]]) -> tuple[int, int]:
        """``(rows, cols)`` of a device launch whose input tensors, in declared order, have ``shapes``; each
        shape is checked against its input's (a wrong one would read past a device buffer)."""
        names = ", ".join(spec.name for spec in self.inputs)
        if len(shapes) != len(self.inputs):
            raise TypeError(f"epilogue {self.entry_point} takes {len(self.inputs)} tensors ({names}), not {len(shapes)}")
        full = next((shape for spec, shape in zip(self.inputs, shapes) if spec.shape is Shape.FULL), None)
        if full is None or len(full) != 2:
            raise TypeError(f"epilogue {self.entry_point}: no [rows, cols] input tensor fixes the output's shape")
        rows, cols = full
        for spec, shape in zip(self.inputs, shapes):
            expected = {Shape.FULL: (rows, cols), Shape.COLS: (cols,), Shape.ROWS: (rows,)}[spec.shape]
            if tuple(shape) != expected:
                raise ValueError(f"epilogue input {spec.name!r} has shape {tuple(shape)}, expected {expected}")
        return rows, cols

    def render(self, target: str) -> RenderedKernel:
        """Source for one target ("cuda", "hip", "metal", "wgsl", "opencl", "slang")."""
        return render_many([self], target)[0]

    def numpy_fn(self) -> Callable[..., dict[str, Any]]:
        """`fn(**inputs_and_params) -> {output: ndarray}`, computed in float32 with numpy."""
        return evaluate.numpy_fn(self)

    def jax_fn(self) -> Callable[..., dict[str, Any]]:
        """The same as `numpy_fn` with jax.numpy, jitted; imports jax on first call."""
        return evaluate.jax_fn(self)
