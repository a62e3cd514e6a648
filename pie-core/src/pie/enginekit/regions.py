"""Where a described region's values stand among its launcher's arguments.

A region's launcher takes the values ``RegionRequest.inputs`` names, positionally, and returns those
``outputs`` names, in the order Poem chose. An engine that runs a described region as one unit
(``RegionRequest.attention_input``) needs each role's position (the norm weight, the QKV weight, the
rotary inputs) and the outputs' order; this reads them from the description once, when the region is
compiled, so that no engine works them out again.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pie.contract import DecoderLayerBlock, RegionRequest


@dataclass(frozen=True)
class AttentionInputSignature:
    """An attention-input region's layer, its argument positions (None: the layer has no such input) and the
    widths of q and of k and v."""

    layer: DecoderLayerBlock
    x: int
    norm: int
    weight: int
    bias: int | None
    q_norm: int | None
    k_norm: int | None
    positions: int
    inv_freq: int
    q_width: int
    kv_width: int
    outputs: Callable[[tuple[Any, Any, Any]], tuple[Any, ...]]
    """``(q, k, v)`` -> the region's outputs, in ``RegionRequest.outputs`` order."""


def attention_input_signature(region: RegionRequest) -> AttentionInputSignature | None:
    """The positions of ``region.attention_input``'s values, or None when the region is not described as one,
    does not export exactly its q, k and v, or lacks the per-head norms its layer declares (then it is lowered
    kernel by kernel)."""
    described = region.attention_input
    if described is None or set(region.outputs) != {described.q, described.k, described.v}:
        return None
    layer = described.layer
    position: dict[str | None, int] = {name: index for index, name in enumerate(region.inputs)}
    slot = {described.q: 0, described.k: 1, described.v: 2}
    q_norm = k_norm = None
    if layer.qk_norm:
        q_norm, k_norm = (position.get(layer.weight(role)) for role in ("q_norm", "k_norm"))
        if q_norm is None or k_norm is None:
            return None
    return AttentionInputSignature(
        layer=layer,
        x=position[layer.x],
        norm=position[layer.weight("attn_norm")],
        weight=position[layer.weight("qkv")],
        bias=position.get(layer.weight("qkv_bias")),
        q_norm=q_norm,
        k_norm=k_norm,
        positions=position[layer.positions],
        inv_freq=position[layer.inv_freq],
        q_width=layer.num_heads * layer.head_dim,
        kv_width=layer.num_kv_heads * layer.head_dim,
        outputs=operator.itemgetter(*(slot[name] for name in region.outputs)),
    )
