"""What an engine that runs decoder layers as one unit reads from their descriptions (`pie.enginekit.blocks`)."""

from __future__ import annotations

from dataclasses import replace

from pie.contract import DecoderLayerBlock, RegionRequest
from pie.enginekit.blocks import described_layer, layer_roles, layer_weight_shapes, stacked_layers

PASS_INPUTS = ("positions", "slots", "qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")
"""The pass inputs, each named here as its `DecoderLayerBlock` field."""
ROLES = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")


def layer(index: int, **options: object) -> DecoderLayerBlock:
    return DecoderLayerBlock(
        layer=index, weights=tuple((role, f"w.L{index}.{role}") for role in ROLES), x=f"x{index}",
        output=f"x{index + 1}", pool="pool", inv_freq="inv_freq", **{name: name for name in PASS_INPUTS},
        hidden=64, intermediate=96, num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-6, scale=0.25,
        **options,  # type: ignore[arg-type]
    )


def block(described: DecoderLayerBlock) -> RegionRequest:
    inputs = (described.x, described.pool, described.inv_freq, *PASS_INPUTS, *(name for _, name in described.weights))
    return RegionRequest(f"L{described.layer}", (), inputs, (described.output,), layer=described)


def test_the_roles_follow_the_options() -> None:
    assert "q_norm" not in layer_roles(layer(0)) and {"qkv_bias", "o_bias"} <= set(layer_roles(layer(0)))
    roles = layer_roles(layer(0, qk_norm=True, post_norms=True))
    assert {"q_norm", "k_norm", "attn_post_norm", "mlp_post_norm"} <= set(roles)


def test_each_weight_has_the_shape_the_layer_states() -> None:
    shapes = layer_weight_shapes(layer(0))
    assert shapes["qkv"] == (64 + 2 * 32, 64) and shapes["o"] == (64, 64) and shapes["q_norm"] == (16,)
    assert shapes["gate_up"] == (192, 64) and shapes["down"] == (64, 96) and shapes["qkv_bias"] == (128,)


def test_a_block_is_its_layer_only_when_it_reads_and_writes_what_the_description_names() -> None:
    described = layer(0)
    assert described_layer(block(described)) is described
    assert described_layer(replace(block(described), layer=None)) is None
    assert described_layer(block(replace(described, qk_norm=True))) is None, "Q/K norms, no weights"
    assert described_layer(replace(block(described), outputs=("x1", "inner"))) is None, "an inner value read outside"
    unread = replace(block(described), inputs=block(described).inputs[:-1])
    assert described_layer(unread) is None, "a described weight the block does not read"
    without_o = replace(described, weights=tuple(w for w in described.weights if w[0] != "o"))
    assert described_layer(block(without_o)) is None, "a weight the layer needs is not described"
    biased = replace(described, weights=(*described.weights, ("qkv_bias", "w.L0.qkv_bias")))
    assert described_layer(block(biased)) is biased


def test_a_stack_chains_its_layers_through_one_pool() -> None:
    layers = [layer(i) for i in range(3)]
    blocks = tuple(map(block, layers))
    inputs = tuple(dict.fromkeys(name for b in blocks for name in b.inputs if name not in ("x1", "x2")))
    stack = RegionRequest("stack", (), inputs, ("x3",))
    assert stacked_layers(stack, blocks) == tuple(layers)
    assert stacked_layers(stack, (blocks[1], blocks[0], blocks[2])) is None, "out of order"
    assert stacked_layers(stack, (blocks[0], blocks[2])) is None, "a layer left out"
    assert stacked_layers(stack, ()) is None
    assert stacked_layers(replace(stack, outputs=("x1", "x3")), blocks) is None, "an inner value read outside"
    assert stacked_layers(replace(stack, inputs=inputs[1:]), blocks) is None, "the stack does not read x0"
    other_pool = block(replace(layers[1], pool="pool2"))
    assert stacked_layers(replace(stack, inputs=(*inputs, "pool2")), (blocks[0], other_pool, blocks[2])) is None
