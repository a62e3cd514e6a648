"""The forward pass of a decoder as a flat graph of catalogue ops.

Values are named: ``w.*`` are weights, ``in.*`` are per-batch inputs, ``kv.pool``
is the engine's page pool, everything else is an activation produced by an op.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pie.contract import AttentionInputRegion, AttentionRegion, DecoderLayerBlock
from pie.model.config import ModelConfig

POOL = "kv.pool"


@dataclass(frozen=True)
class Op:
    kind: str
    """A catalogue kernel name (see :mod:`pie.kernels`)."""
    inputs: tuple[str | None, ...]
    output: str | None
    options: tuple[tuple[str, Any], ...] = ()
    tag: str = ""
    """What the op belongs to (e.g. ``L3.attn_in``), used to label regions."""
    block: str = ""
    """The unit of the model the op is part of (a decoder layer, ``L3``): Poem offers an engine the
    regions of one block as one launch (see ``pie_compile_block``). Empty for ops of no block."""

    @property
    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass
class Graph:
    ops: list[Op] = field(default_factory=list)
    output: str = "logits"
    layers: dict[str, DecoderLayerBlock] = field(default_factory=dict)
    """The decoder layer each block is, by block name (``L3``): Poem offers it with the block."""
    attention_inputs: dict[str, AttentionInputRegion] = field(default_factory=dict)
    """The attention input of a described layer, by the tag of its ops (``L3.attn_in``): Poem offers it with
    the region of exactly those ops."""
    attentions: dict[str, AttentionRegion] = field(default_factory=dict)
    """The append_kv and attention of a described layer, by the tag of its ops (``L3.attention``): Poem
    offers it with the region of exactly those ops."""

    def add(
        self, kind: str, inputs: tuple[str | None, ...], output: str | None, tag: str, block: str = "", **options: Any
    ) -> str | None:
        self.ops.append(Op(kind, inputs, output, tuple(sorted(options.items())), tag, block))
        return output

    def use_counts(self) -> Counter[str]:
        counts: Counter[str] = Counter(name for op in self.ops for name in op.inputs if name)
        counts[self.output] += 1
        return counts

    def weights(self) -> list[str]:
        seen = dict.fromkeys(name for op in self.ops for name in op.inputs if name and name.startswith("w."))
        return list(seen)


@dataclass(frozen=True)
class LogitEpilogue:
    """A user's eta program applied to the logits on the device: one f32 input (the logits), one f32
    output (the logits the sampler sees), a value for each of its params."""

    source: str
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        from pie import eta
        from pie.eta.checker import float_bits
        from pie.eta.types import DType

        program = eta.compile(self.source)
        if len(program.inputs) != 1 or program.inputs[0].dtype is not DType.F32:
            inputs = ", ".join(f"{spec.name}: {spec.dtype}" for spec in program.inputs)
            raise ValueError(f"a logit epilogue takes one f32 input (the logits), this one takes {inputs}")
        if len(program.outputs) != 1 or program.outputs[0].dtype is not DType.F32:
            outputs = ", ".join(f"{spec.name}: {spec.dtype}" for spec in program.outputs)
            raise ValueError(f"a logit epilogue gives one f32 output (the new logits), this one gives {outputs}")
        declared = {spec.name: spec.dtype for spec in program.params}
        takes = f"it takes {', '.join(declared)}" if declared else "it takes none"
        seen: set[str] = set()
        for name, value in self.params:
            if name in seen:
                raise ValueError(f"the logit epilogue's param {name} is given twice")
            seen.add(name)
            if name not in declared:
                raise ValueError(f"the logit epilogue has no param named {name!r} ({takes})")
            if math.isnan(value):
                raise ValueError(f"the logit epilogue's param {name} is NaN")
            dtype = declared[name]
            # In range when it rounds to a finite value of its type (3.4028235e38, f32's largest as numpy
            # prints it, is); an infinite value is taken as given. repr: value and bound never read the same.
            if dtype.is_float and math.isfinite(value) and float_bits(value, dtype) is None:
                raise ValueError(
                    f"the logit epilogue's param {name} is {value!r}, beyond {dtype}'s range (±{dtype.largest!r})"
                )
            if dtype is DType.I32 and not (float(value).is_integer() and -(2**31) <= value < 2**31):
                raise ValueError(f"the logit epilogue's param {name} is an i32; {value!r} is not one")
        missing = set(declared) - seen
        if missing:
            raise ValueError(f"the logit epilogue needs values for its params: {', '.join(sorted(missing))}")
        # An i32 param reaches the kernels' packers as an int (a float is no value for a C int field).
        typed = tuple((name, int(value) if declared[name] is DType.I32 else value) for name, value in self.params)
        object.__setattr__(self, "params", typed)


def build_decoder_graph(config: ModelConfig, logit_epilogue: LogitEpilogue | None = None) -> Graph:
    """The forward pass of ``config``'s architecture (`pie.models`); ``logit_epilogue`` appends a user's
    eta program to the LM head (e.g. soft-capping), which Poem places in the head's region."""
    from pie.models import architecture_of
    from pie.models.decoder import build_graph

    return build_graph(architecture_of(config), config, logit_epilogue)
