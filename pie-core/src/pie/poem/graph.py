"""The forward pass of a decoder as a flat graph of catalogue ops.

Values are named: ``w.*`` are weights, ``in.*`` are per-batch inputs, ``kv.pool``
is the engine's page pool, everything else is an activation produced by an op.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pie.model.config import ModelConfig

BATCH_INPUTS = (
    "in.ids",
    "in.positions",
    "in.slots",
    "in.qo_indptr",
    "in.kv_page_indices",
    "in.kv_page_indptr",
    "in.kv_last_page_lens",
    "in.sample_rows",
)
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


def has_output_bias(config: ModelConfig) -> bool:
    """Llama with ``attention_bias`` biases all four projections; Qwen2 only Q, K and V."""
    return config.attention_bias and config.architecture == "llama"


@dataclass(frozen=True)
class LogitEpilogue:
    """A user's eta program applied to the logits on the device: one f32 input (the logits), one f32
    output (the logits the sampler sees), a value for each of its params."""

    source: str
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        from pie import eta
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
            if declared[name] is DType.I32 and not (float(value).is_integer() and -(2**31) <= value < 2**31):
                raise ValueError(f"the logit epilogue's param {name} is an i32; {value:g} is not one")
        missing = set(declared) - seen
        if missing:
            raise ValueError(f"the logit epilogue needs values for its params: {', '.join(sorted(missing))}")


def _add_layer_op(
    graph: Graph, index: int, kind: str, inputs: tuple[str | None, ...], output: str | None, part: str, **options: Any
) -> str | None:
    """An op of decoder layer ``index``: tagged ``L{index}.{part}``, in block ``L{index}``."""
    return graph.add(kind, inputs, output, f"L{index}.{part}", block=f"L{index}", **options)


def build_decoder_graph(config: ModelConfig, logit_epilogue: LogitEpilogue | None = None) -> Graph:
    """The Llama-family forward pass: fused QKV and gate/up weights, paged attention.

    ``logit_epilogue`` appends an eta epilogue to the LM head (e.g. soft-capping), which Poem
    places in the head's region and the engine compiles.
    """
    graph = Graph()
    d = config.head_dim
    q_width, kv_width = config.num_heads * d, config.num_kv_heads * d
    eps = float(config.rms_norm_eps)
    x = graph.add("embedding", ("in.ids", "w.embed"), "x.embed", "embed")
    for i in range(config.num_layers):
        p, w = f"L{i}.", f"w.L{i}."
        add = partial(_add_layer_op, graph, i)
        add("rms_norm", (x, w + "ln1"), p + "norm1", "attn_in", eps=eps)
        bias = w + "qkv_bias" if config.attention_bias else None
        add("linear", (p + "norm1", w + "qkv", bias), p + "qkv", "attn_in")
        add("slice_columns", (p + "qkv",), p + "q", "attn_in", start=0, stop=q_width)
        add("slice_columns", (p + "qkv",), p + "k", "attn_in", start=q_width, stop=q_width + kv_width)
        add("slice_columns", (p + "qkv",), p + "v", "attn_in", start=q_width + kv_width, stop=q_width + 2 * kv_width)
        add("rope", (p + "q", "in.positions", "w.inv_freq"), p + "q_rot", "attn_in", head_dim=d)
        add("rope", (p + "k", "in.positions", "w.inv_freq"), p + "k_rot", "attn_in", head_dim=d)
        add("append_kv", (POOL, p + "k_rot", p + "v", "in.slots"), None, "attention", layer=i)
        add(
            "attention",
            (p + "q_rot", POOL, "in.qo_indptr", "in.kv_page_indices", "in.kv_page_indptr", "in.kv_last_page_lens"),
            p + "attn",
            "attention",
            layer=i,
            num_heads=config.num_heads,
            scale=float(d) ** -0.5,
        )
        add("linear", (p + "attn", w + "o", w + "o_bias" if has_output_bias(config) else None), p + "o", "attn_out")
        x = add("add", (p + "o", x), p + "x_attn", "attn_out")
        add("rms_norm", (x, w + "ln2"), p + "norm2", "mlp_in", eps=eps)
        add("linear", (p + "norm2", w + "gate_up", None), p + "gate_up", "mlp_in")
        add("silu_mul", (p + "gate_up",), p + "mlp_hidden", "mlp_in")
        add("linear", (p + "mlp_hidden", w + "down", None), p + "down", "mlp_out")
        x = add("add", (p + "down", x), p + "x_out", "mlp_out")
    graph.add("gather_rows", (x, "in.sample_rows"), "head.rows", "head")
    graph.add("rms_norm", ("head.rows", "w.norm"), "head.norm", "head", eps=eps)
    if logit_epilogue is None:
        graph.add("linear", ("head.norm", "w.lm_head", None), graph.output, "head")
        return graph
    graph.add("linear", ("head.norm", "w.lm_head", None), "head.logits", "head")
    graph.add(
        "epilogue",
        ("head.logits",),
        graph.output,
        "head",
        source=logit_epilogue.source,
        params=tuple(sorted(logit_epilogue.params)),
    )
    return graph
