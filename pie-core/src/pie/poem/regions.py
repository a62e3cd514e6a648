"""The fusion pass: partition a graph into regions of the shape ``prologue* anchor epilogue*``.

An anchor is an op that reads a large operand (a projection, attention, a
gather); prologues are the cheap ops that prepare its input (a norm, writing the
KV cache); epilogues are elementwise ops on its output (bias, RoPE, SiLU-gating,
residual add). A norm tagged with its anchor's own part (a post-norm, as Gemma's)
is an epilogue of that region, so that the next region opens with its own ops.
Each region is one unit of lowering: one fused kernel where the engine has it,
else its ops one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pie.poem.graph import Graph, Op

ANCHORS = frozenset({"linear", "attention", "embedding"})
PROLOGUES = frozenset({"rms_norm", "append_kv", "gather_rows"})
EPILOGUES = frozenset({"add", "silu_mul", "rope", "rms_norm_heads", "slice_columns", "softmax", "argmax", "epilogue"})


@dataclass
class Region:
    label: str
    ops: list[Op] = field(default_factory=list)
    has_anchor: bool = False


def partition(graph: Graph) -> list[Region]:
    regions: list[Region] = []
    current: Region | None = None
    for op in graph.ops:
        # A post-norm (a norm of its anchor's own part, as Gemma's) finishes that region rather than opening one.
        post_norm = op.kind in PROLOGUES and current is not None and current.has_anchor and op.tag == current.label
        if op.kind in ANCHORS or (op.kind in PROLOGUES and not post_norm):
            if current is None or current.has_anchor:
                current = Region(op.tag)
                regions.append(current)
            if op.kind in ANCHORS:
                current.has_anchor = True
                current.label = op.tag
        elif op.kind in EPILOGUES or post_norm:
            if current is None:
                current = Region(op.tag)
                regions.append(current)
        else:
            raise ValueError(f"Poem does not know how to place op kind {op.kind!r}")
        current.ops.append(op)
    _disambiguate(regions)
    return regions


def _disambiguate(regions: list[Region]) -> None:
    seen: dict[str, int] = {}
    for region in regions:
        count = seen.get(region.label, 0)
        seen[region.label] = count + 1
        if count:
            region.label = f"{region.label}#{count}"
