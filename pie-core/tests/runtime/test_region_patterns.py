"""The attention-input pattern engines share: what it accepts and where a launcher finds its arguments."""

from __future__ import annotations

from dataclasses import replace

from pie.contract import RegionOp
from pie.poem.patterns import AttentionInput
from pie.testing.regions import attention_input_region


def test_the_region_matches_and_places_its_arguments_and_outputs() -> None:
    region = attention_input_region(96, 32, 16, bias=True, outputs=("v", "q_rot", "k_rot"))
    layout = AttentionInput.match(region.ops)
    assert layout is not None
    assert (layout.q_width, layout.kv_width, layout.head_dim, layout.eps) == (96, 32, 16, 1e-5)
    at = layout.arguments(region)
    assert at is not None
    assert (at.x, at.norm, at.weight, at.bias, at.positions, at.inv_freq) == (0, 1, 2, 3, 4, 5)
    assert at.outputs("q", "k", "v") == ("v", "q", "k")


def test_without_bias_and_in_another_order() -> None:
    region = attention_input_region(64, 64, 16, bias=False, outputs=("k_rot", "q_rot", "v"))
    at = AttentionInput.match(region.ops).arguments(region)
    assert at is not None and at.bias is None and (at.positions, at.inv_freq) == (3, 4)
    assert at.outputs("q", "k", "v") == ("k", "q", "v")


def test_regions_that_do_not_export_q_k_and_v_or_do_not_chain_are_refused() -> None:
    region = attention_input_region(96, 32, 16, bias=False)
    layout = AttentionInput.match(region.ops)
    assert layout.arguments(replace(region, outputs=("q_rot", "k_rot"))) is None
    assert layout.arguments(replace(region, outputs=("q_rot", "k_rot", "qkv"))) is None
    unchained = list(region.ops)
    unchained[6] = RegionOp("rope", ("q", "positions", "inv_freq"), "k_rot", (("head_dim", 16),))
    assert AttentionInput.match(tuple(unchained)) is None
