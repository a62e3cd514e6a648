"""Regions as Poem offers them to engines, built by hand for the engines' region tests."""

from __future__ import annotations

from pie.contract import RegionOp, RegionRequest


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
