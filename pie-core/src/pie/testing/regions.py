"""Regions as Poem offers them to engines, built by hand for the engines' region tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from pie.contract import AttentionInputRegion, DecoderLayerBlock, RegionOp, RegionRequest


def attention_input_region(
    q_width: int, kv_width: int, head_dim: int, bias: bool, outputs: tuple[str, ...] = ("v", "q_rot", "k_rot")
) -> RegionRequest:
    """The attention-input region (RMSNorm, QKV projection, three slices, two RoPEs) of one layer.

    Its launcher takes ``x, ln, w, [b,] positions, inv_freq`` and returns ``outputs``, named among
    ``q_rot``, ``k_rot`` and ``v``; the ops are in graph order, so tests may swap one to break the chain.
    """
    q, kv = q_width, kv_width
    ops = (
        RegionOp("rms_norm", ("x", "ln"), "normed", (("eps", 1e-5),)),
        RegionOp("linear", ("normed", "w", "b" if bias else None), "qkv"),
        RegionOp("slice_columns", ("qkv",), "q", (("start", 0), ("stop", q))),
        RegionOp("slice_columns", ("qkv",), "k", (("start", q), ("stop", q + kv))),
        RegionOp("slice_columns", ("qkv",), "v", (("start", q + kv), ("stop", q + 2 * kv))),
        RegionOp("rope", ("q", "positions", "inv_freq"), "q_rot", (("head_dim", head_dim),)),
        RegionOp("rope", ("k", "positions", "inv_freq"), "k_rot", (("head_dim", head_dim),)),
    )
    inputs = ("x", "ln", "w", *(("b",) if bias else ()), "positions", "inv_freq")
    return RegionRequest("L0.attn_in", ops, inputs, outputs)


def described_attention_input_region(
    q_width: int, kv_width: int, head_dim: int, hidden: int, bias: bool, **layer_options: Any
) -> RegionRequest:
    """:func:`attention_input_region` with its description (``RegionRequest.attention_input``), as Poem offers
    a layer's: the `DecoderLayerBlock` of layer 0 naming the region's inputs (``layer_options`` change it)."""
    weights = (("attn_norm", "ln"), ("qkv", "w"), *((("qkv_bias", "b"),) if bias else ()))
    layer = DecoderLayerBlock(
        layer=0, weights=weights, x="x", output="L0.x_out", pool="pool", positions="positions", inv_freq="inv_freq",
        slots="slots", qo_indptr="qo", kv_page_indices="indices", kv_page_indptr="indptr", kv_last_page_lens="last",
        hidden=hidden, intermediate=64, num_heads=q_width // head_dim, num_kv_heads=kv_width // head_dim,
        head_dim=head_dim, eps=1e-5, scale=0.25,
    )
    region = attention_input_region(q_width, kv_width, head_dim, bias)
    return replace(region, attention_input=AttentionInputRegion(replace(layer, **layer_options), "q_rot", "k_rot", "v"))


def attention_input_arguments(
    q_width: int, kv_width: int, head_dim: int, hidden: int, tokens: int, bias: bool
) -> tuple[np.ndarray, ...]:
    """Random host arguments of :func:`attention_input_region`'s launcher, in its order: ``x, ln, w, [b,]
    positions, inv_freq`` (seeded by ``tokens`` and ``bias``, so each case draws the same values)."""
    rng = np.random.default_rng(tokens + bias)
    width = q_width + 2 * kv_width
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    ln = rng.standard_normal(hidden, dtype=np.float32)
    w = rng.standard_normal((width, hidden), dtype=np.float32) * 0.1
    b = rng.standard_normal(width, dtype=np.float32)
    positions = rng.integers(0, 300, tokens).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    return (x, ln, w, *((b,) if bias else ()), positions, inv_freq)
