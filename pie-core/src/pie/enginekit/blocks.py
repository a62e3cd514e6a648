"""What a described decoder layer reads and holds, for an engine that runs layers as one unit.

A block offered with its layer's description (``RegionRequest.layer``, a `DecoderLayerBlock`) may be
run as one launch (``pie_compile_block``), and a stack of them as one (``pie_compile_stack``). Such an
engine needs the roles the layer computes with, the shape of each weight, and whether the block (or the
stack) reads and writes exactly what the descriptions name; these read them from the descriptions, so
that no engine works them out from the ops.
"""

from __future__ import annotations

from pie.contract import LAYER_WEIGHT_ROLES, DecoderLayerBlock, RegionRequest
from pie.plugins import EngineError

BIASES = ("qkv_bias", "o_bias")
"""The roles a layer may leave out: it then adds no bias."""


def layer_roles(layer: DecoderLayerBlock) -> tuple[str, ...]:
    """The roles of `LAYER_WEIGHT_ROLES` the layer computes with, in that order: Q/K norms only with
    ``qk_norm``, post-norms only with ``post_norms``; the biases always (they may be absent)."""
    optional = {"q_norm": layer.qk_norm, "k_norm": layer.qk_norm,
                "attn_post_norm": layer.post_norms, "mlp_post_norm": layer.post_norms}
    return tuple(role for role in LAYER_WEIGHT_ROLES if optional.get(role, True))


def layer_weight_shapes(layer: DecoderLayerBlock) -> dict[str, tuple[int, ...]]:
    """The shape of each role's weight (every role of `LAYER_WEIGHT_ROLES`), as `DecoderLayerBlock` states
    the layer: matrices ``[out_features, in_features]``, the gate rows of ``gate_up`` first."""
    hidden, inter, head_dim = layer.hidden, layer.intermediate, layer.head_dim
    q_width, kv_width = layer.num_heads * head_dim, layer.num_kv_heads * head_dim
    return {
        "attn_norm": (hidden,), "qkv": (q_width + 2 * kv_width, hidden), "qkv_bias": (q_width + 2 * kv_width,),
        "q_norm": (head_dim,), "k_norm": (head_dim,), "o": (hidden, q_width), "o_bias": (hidden,),
        "attn_post_norm": (hidden,), "mlp_norm": (hidden,), "gate_up": (2 * inter, hidden),
        "down": (hidden, inter), "mlp_post_norm": (hidden,),
    }


def layer_reads(layer: DecoderLayerBlock) -> set[str]:
    """The inputs the layer reads besides its residual stream ``x``: its page pool, rotary frequencies,
    the pass inputs and the weights of the roles it computes with."""
    weights = (layer.weight(role) for role in layer_roles(layer))
    return {layer.pool, layer.inv_freq, *layer.pass_inputs, *(name for name in weights if name is not None)}


def check_head_dim(engine: str, block: RegionRequest, max_head_dim: int | None) -> None:
    """Refuse a decoder layer (``block.layer``) whose head_dim is beyond ``max_head_dim``, what the engine's
    attention takes (None: any), with an EngineError saying so; for an engine's ``pie_compile_block``, so that
    lowering stops before the weights load, not at the model's first step."""
    layer = block.layer
    if max_head_dim is not None and layer is not None and layer.head_dim > max_head_dim:
        raise EngineError(f"engine {engine!r} runs attention with head_dim up to {max_head_dim}; this model's is "
                          f"{layer.head_dim} (use --engine cpu or xla)")


def described_layer(block: RegionRequest) -> DecoderLayerBlock | None:
    """``block.layer`` when the block can run as the layer its description states: a weight is named for
    every role the layer computes with (but the biases), the block reads every input the description names
    and writes only its output. Else None (no description, or one the block does not match)."""
    layer = block.layer
    if layer is None:
        return None
    if any(layer.weight(role) is None for role in layer_roles(layer) if role not in BIASES):
        return None
    if not {layer.x, *layer_reads(layer)} <= set(block.inputs) or block.outputs != (layer.output,):
        return None
    return layer


def stacked_layers(stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> tuple[DecoderLayerBlock, ...] | None:
    """The layers of ``blocks`` (each a `described_layer`) when each reads the one before's output through the
    first one's page pool and pass inputs, and ``stack`` reads what they all read and writes the last one's
    output; else None. The layers may differ in their options and rotary frequencies (sliding-window and
    global layers may alternate)."""
    described = tuple(layer for layer in map(described_layer, blocks) if layer is not None)
    if not described or len(described) != len(blocks):
        return None
    first = described[0]
    chained = all(
        layer.x == before.output and layer.pool == first.pool and layer.pass_inputs == first.pass_inputs
        for before, layer in zip(described, described[1:])
    )
    read = {first.x}.union(*map(layer_reads, described))
    if not chained or stack.outputs != (described[-1].output,) or not read <= set(stack.inputs):
        return None
    return described
