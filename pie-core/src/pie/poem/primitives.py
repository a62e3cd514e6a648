"""A region as a program of catalogue primitives over numbered values.

An engine that compiles a whole region into one program of its own (XLA traces it into one
jitted function) reads the region this way: values numbered with the region's inputs first,
each fused kernel expanded into the chain of primitives it stands for (:mod:`pie.poem.fusions`),
and the ``layer`` option of the pool kernels pulled out as a runtime scalar. Regions that
differ only in their layer (the same ops of every decoder layer) then have equal
:class:`PrimitiveRegion`s and can share one compiled program.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pie.contract import RegionRequest
from pie.kernels import ARG_ROLES, POOL_KERNELS, attention_options
from pie.poem.fusions import CHAINED, FUSED


@dataclass(frozen=True)
class Step:
    """One primitive of a region program, over numbered values (region inputs come first)."""

    kernel: str
    inputs: tuple[int | None, ...]
    output: int
    options: tuple[tuple[str, Any], ...]
    layer: int | None
    """Index of the program's layer scalar this step reads, if any."""


@dataclass(frozen=True)
class PrimitiveRegion:
    """What a region computes over numbered values (its inputs first): equal ones share a program."""

    num_inputs: int
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    donated: int | None
    """The pool input the region writes: an engine may update it in place, replacing its array after."""
    pool_value: int | None
    """The value holding the written pool."""

    def input_roles(self) -> list[str]:
        """The role (:data:`pie.kernels.ARG_ROLES`) of each region input, from the first step that reads it."""
        roles = ["act"] * self.num_inputs
        seen: set[int] = set()
        for step in self.steps:
            for position, value in enumerate(step.inputs):
                if value is not None and value < self.num_inputs and value not in seen:
                    seen.add(value)
                    roles[value] = ARG_ROLES[step.kernel][position]
        return roles


def primitive_region(
    region: RegionRequest, primitives: Collection[str], engine: str
) -> tuple[PrimitiveRegion, tuple[int, ...]]:
    """Number a region's values and expand fused kernels into ``primitives`` (the engine's): the program,
    and the layer option of each layer scalar. A kernel that is neither fails, naming ``engine``."""
    ids: dict[str, int] = {name: index for index, name in enumerate(region.inputs)}
    steps: list[Step] = []
    layers: list[int] = []
    pool_input: int | None = None
    pool_value: int | None = None

    def emit(kernel: str, inputs: tuple[int | None, ...], options: dict[str, Any]) -> int:
        nonlocal pool_input, pool_value
        output, layer = len(region.inputs) + len(steps), None
        if kernel in POOL_KERNELS:  # their ``layer`` is a runtime scalar after the tensors
            value = int(options.pop("layer"))
            if value not in layers:
                layers.append(value)
            layer = layers.index(value)
            if pool_input is None:
                pool_input = inputs[0 if kernel == "append_kv" else 1]
        if kernel == "attention":
            # Off options are dropped: the program (and its compile cache entry) is the one without them.
            window, softcap = attention_options(options.pop("window", 0), options.pop("softcap", 0.0))
            options.update((name, value) for name, value in (("window", window), ("softcap", softcap)) if value)
        if kernel == "append_kv":
            pool_value = output
        steps.append(Step(kernel, inputs, output, tuple(sorted(options.items())), layer))
        return output

    for op in region.ops:
        inputs = tuple(None if name is None else ids[name] for name in op.inputs)
        options = dict(op.options)
        if op.kernel in FUSED:
            chained: int | None = None
            for link in FUSED[op.kernel].chain:
                args = tuple(
                    inputs[i] if isinstance(i, int) and i < len(inputs) else chained if i == CHAINED else None
                    for i in link.inputs
                )
                chained = result = emit(link.kind, args, {name: options[name] for name in link.options})
        elif op.kernel in primitives:
            result = emit(op.kernel, inputs, options)
        else:
            raise KeyError(f"the {engine} engine has no kernel {op.kernel!r}")
        if op.kernel == "append_kv" and (pool := op.inputs[0]) is not None:
            ids[pool] = result  # later readers of the pool see the written pool
        elif op.output is not None:
            ids[op.output] = result
    outputs = tuple(ids[name] for name in region.outputs)
    donated = pool_input if pool_value is not None else None
    return PrimitiveRegion(len(region.inputs), tuple(steps), outputs, donated, pool_value), tuple(layers)
