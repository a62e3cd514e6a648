"""The fused catalogue kernels, each stated once as the chain of primitives it replaces.

Poem's lowering reads a chain forwards (which ops one fused kernel covers, and its arguments);
an engine that has no fused kernel of its own reads it backwards (the primitives a fused
kernel expands to).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pie.poem.graph import Op

CHAINED = "chained"
"""In a `Link`'s inputs: the previous link's output."""


@dataclass(frozen=True)
class Link:
    """One primitive of a fused chain.

    ``inputs`` follow the primitive's signature: the fused kernel's argument index each comes from,
    `CHAINED`, or None for an input the fusion requires absent (a bias it does not add). ``options``
    names the fused kernel's options this primitive takes.
    """

    kind: str
    inputs: tuple[int | str | None, ...]
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fusion:
    """A chain of ops (each feeding the next, nothing else reading the middle) that one kernel replaces."""

    kernel: str
    chain: tuple[Link, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(link.kind for link in self.chain)

    @property
    def arity(self) -> int:
        return 1 + max(i for link in self.chain for i in link.inputs if isinstance(i, int))

    def arguments(self, ops: list[Op]) -> tuple[tuple[str | None, ...], dict[str, Any]]:
        """The fused kernel's inputs and options, following its catalogue signature.

        In each op after the first, the input that is the previous op's output is the chained one
        (whatever its position, as ``add`` is commutative); its other inputs fill the link's other
        argument indices in order.
        """
        arguments: list[str | None] = [None] * self.arity
        options: dict[str, Any] = {}
        previous: str | None = None
        for link, op in zip(self.chain, ops, strict=True):
            options.update(op.option_dict)
            inputs = list(op.inputs)
            if previous is not None:
                inputs.remove(previous)
            for index, name in zip([i for i in link.inputs if i != CHAINED], inputs, strict=True):
                if isinstance(index, int):
                    arguments[index] = name
            previous = op.output
        return tuple(arguments), options

    def matches(self, ops: list[Op], uses: Mapping[str, int]) -> bool:
        if tuple(op.kind for op in ops) != self.kinds:
            return False
        for producer, consumer in zip(ops, ops[1:], strict=False):
            if producer.output is None or producer.output not in consumer.inputs or uses[producer.output] != 1:
                return False
        return all(
            op.inputs[position] is None
            for link, op in zip(self.chain, ops, strict=True)
            for position, index in enumerate(link.inputs)
            if index is None
        )


FUSIONS = (
    Fusion(
        "rms_norm_gate_up_silu",
        (Link("rms_norm", (0, 1), ("eps",)), Link("linear", (CHAINED, 2, None)), Link("silu_mul", (CHAINED,))),
    ),
    Fusion("rms_norm_linear", (Link("rms_norm", (0, 1), ("eps",)), Link("linear", (CHAINED, 2, 3)))),
    Fusion("linear_add", (Link("linear", (0, 1, None)), Link("add", (CHAINED, 2)))),
)
"""Longest first: lowering tries them in this order."""
FUSED: dict[str, Fusion] = {fusion.kernel: fusion for fusion in FUSIONS}
