"""Op patterns of the decoder graph that engines recognize in the regions Poem offers them.

An engine that runs a whole region as one unit checks that its ops chain as `pie.models.decoder`
builds them before taking it; these are the shared checks. A whole decoder layer needs none: its block
comes with a `pie.contract.DecoderLayerBlock` that says what it is, its attention-input region with a
`pie.contract.AttentionInputRegion` and its attention region with a `pie.contract.AttentionRegion`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pie.contract import RegionOp, RegionRequest

ATTENTION_INPUT = ("rms_norm", "linear", "slice_columns", "slice_columns", "slice_columns", "rope", "rope")


def op_option(op: RegionOp, key: str) -> Any:
    return dict(op.options)[key]


@dataclass(frozen=True)
class AttentionInput:
    """The attention-input ops of a region or block, checked to chain as the decoder graph builds them."""

    norm: RegionOp
    projection: RegionOp
    rope_q: RegionOp
    rope_k: RegionOp
    v_slice: RegionOp
    q_width: int
    kv_width: int
    head_dim: int
    eps: float

    @classmethod
    def match(cls, ops: tuple[RegionOp, ...]) -> AttentionInput | None:
        if tuple(op.kernel for op in ops) != ATTENTION_INPUT:
            return None
        norm, projection, q_slice, k_slice, v_slice, rope_q, rope_k = ops
        chained = (
            projection.inputs[0] == norm.output
            and all(s.inputs == (projection.output,) for s in (q_slice, k_slice, v_slice))
            and rope_q.inputs[0] == q_slice.output
            and rope_k.inputs[0] == k_slice.output
            and rope_q.inputs[1:] == rope_k.inputs[1:]
            and op_option(rope_q, "head_dim") == op_option(rope_k, "head_dim")
        )
        bounds = [(op_option(s, "start"), op_option(s, "stop")) for s in (q_slice, k_slice, v_slice)]
        q_width, kv_width = bounds[0][1], bounds[1][1] - bounds[1][0]
        contiguous = [(0, q_width), (q_width, q_width + kv_width), (q_width + kv_width, q_width + 2 * kv_width)]
        if not chained or bounds != contiguous:
            return None
        head_dim = int(op_option(rope_q, "head_dim"))
        return cls(norm, projection, rope_q, rope_k, v_slice, q_width, kv_width, head_dim, float(op_option(norm, "eps")))

    def arguments(self, region: RegionRequest) -> AttentionInputArguments | None:
        """Where a launcher of ``region`` (whose ops these are) finds its inputs among its arguments, and
        the order of its outputs; None when the region does not export exactly q, k and v."""
        outputs = {self.rope_q.output: 0, self.rope_k.output: 1, self.v_slice.output: 2}
        if set(region.outputs) != set(outputs):
            return None
        position: dict[str | None, int] = {name: index for index, name in enumerate(region.inputs)}
        norm, projection, rope_q = self.norm, self.projection, self.rope_q
        bias = projection.inputs[2]
        return AttentionInputArguments(
            x=position[norm.inputs[0]],
            norm=position[norm.inputs[1]],
            weight=position[projection.inputs[1]],
            bias=None if bias is None else position[bias],
            positions=position[rope_q.inputs[1]],
            inv_freq=position[rope_q.inputs[2]],
            order=tuple(outputs[name] for name in region.outputs),
        )


@dataclass(frozen=True)
class AttentionInputArguments:
    """Argument positions of an attention-input region's launcher, and its outputs' order."""

    x: int
    norm: int
    weight: int
    bias: int | None
    positions: int
    inv_freq: int
    order: tuple[int, ...]
    """For each output of the region, its index in (q, k, v)."""

    def outputs(self, q: Any, k: Any, v: Any) -> tuple[Any, ...]:
        found = (q, k, v)
        return tuple(found[i] for i in self.order)
