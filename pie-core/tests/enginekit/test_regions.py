"""The kit's reading of a described attention-input region: each role's argument position and the outputs' order."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pie.enginekit.regions import attention_input_signature
from pie.testing.regions import described_attention_input_region

Q, KV, HEAD_DIM, HIDDEN = 64, 32, 16, 48


@pytest.mark.parametrize("bias", [False, True])
def test_positions_follow_the_regions_inputs(bias: bool) -> None:
    region = described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, bias)
    signature = attention_input_signature(region)
    assert signature is not None
    named = {role: region.inputs[at] for role, at in (("x", signature.x), ("norm", signature.norm),
                                                      ("weight", signature.weight), ("positions", signature.positions),
                                                      ("inv_freq", signature.inv_freq))}
    assert named == {"x": "x", "norm": "ln", "weight": "w", "positions": "positions", "inv_freq": "inv_freq"}
    assert (signature.bias is not None and region.inputs[signature.bias] == "b") if bias else signature.bias is None
    assert (signature.q_norm, signature.k_norm) == (None, None)
    assert (signature.q_width, signature.kv_width) == (Q, KV)


def test_inputs_in_another_order_move_the_positions() -> None:
    region = described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, True)
    reordered = replace(region, inputs=tuple(reversed(region.inputs)))
    signature = attention_input_signature(reordered)
    assert signature is not None
    assert reordered.inputs[signature.weight] == "w" and reordered.inputs[signature.x] == "x"
    assert signature.x == len(region.inputs) - 1


def test_outputs_come_back_in_the_regions_order() -> None:
    region = described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, False)  # outputs: v, q_rot, k_rot
    signature = attention_input_signature(region)
    assert signature is not None
    assert signature.outputs(("q", "k", "v")) == ("v", "q", "k")


def test_qk_norm_weights_are_found_by_role() -> None:
    region = described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, False)
    assert region.attention_input is not None
    layer = replace(region.attention_input.layer, qk_norm=True,
                    weights=(*region.attention_input.layer.weights, ("q_norm", "qn"), ("k_norm", "kn")))
    region = replace(region, inputs=(*region.inputs, "kn", "qn"),
                     attention_input=replace(region.attention_input, layer=layer))
    signature = attention_input_signature(region)
    assert signature is not None
    assert (region.inputs[signature.q_norm], region.inputs[signature.k_norm]) == ("qn", "kn")


def test_regions_that_are_not_exactly_an_attention_input_are_not_read() -> None:
    described = described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, False)
    assert attention_input_signature(replace(described, attention_input=None)) is None
    assert attention_input_signature(replace(described, outputs=("q_rot", "k_rot"))) is None


def test_a_region_without_the_norms_its_layer_declares_is_not_read() -> None:
    region = described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, False, qk_norm=True)
    assert attention_input_signature(region) is None
