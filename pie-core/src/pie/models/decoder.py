"""The forward pass of a decoder as a Poem graph, built from its architecture's layer descriptions.

Each `pie.contract.DecoderLayerBlock` becomes the catalogue ops that compute it, in block ``L{i}``,
and the graph keeps the description so that Poem can offer it with the block.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pie.contract import AttentionInputRegion, AttentionRegion, DecoderLayerBlock
from pie.model.config import ModelConfig
from pie.poem.graph import POOL, Graph, LogitEpilogue

from .base import Architecture

PASS_INPUTS = {
    "pool": POOL,
    "positions": "in.positions",
    "slots": "in.slots",
    "qo_indptr": "in.qo_indptr",
    "kv_page_indices": "in.kv_page_indices",
    "kv_page_indptr": "in.kv_page_indptr",
    "kv_last_page_lens": "in.kv_last_page_lens",
}
"""The graph values behind `DecoderLayerBlock`'s pass-wide fields."""

GELU_TANH_MUL = """\
# GeGLU: the gate projection through tanh-approximate GELU, times the up projection.
in gate: f32
in up: f32
out y = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate))) * up
"""
SCALE = """\
in x: f32
param factor: f32
out y = x * factor
"""


def build_graph(architecture: Architecture, config: ModelConfig, logit_epilogue: LogitEpilogue | None = None) -> Graph:
    """The forward pass: embedding, the architecture's layers, final norm and LM head.

    ``logit_epilogue`` appends a user's eta epilogue to the LM head, which Poem places in the head's
    region and the engine compiles.
    """
    graph = Graph()
    eps = float(config.rms_norm_eps)
    x = "x.embed"
    graph.add("embedding", ("in.ids", "w.embed"), x, "embed")
    if architecture.scales_embedding:
        x = "x.scaled"
        graph.add("epilogue", ("x.embed",), x, "embed", source=SCALE, params=(("factor", config.hidden_size**0.5),))
    for i in range(config.num_layers):
        layer = architecture.layer(config, i, x, f"L{i}.x_out", PASS_INPUTS)
        add_layer(graph, layer)
        x = layer.output
    graph.add("gather_rows", (x, "in.sample_rows"), "head.rows", "head")
    graph.add("rms_norm", ("head.rows", "w.norm"), "head.norm", "head", eps=eps)
    epilogues: list[tuple[str, tuple[tuple[str, float], ...]]] = []
    if config.final_softcap:
        from pie.eta.stdlib import SOURCES

        epilogues.append((SOURCES["logit_softcap"], (("cap", float(config.final_softcap)),)))
    if logit_epilogue is not None:
        epilogues.append((logit_epilogue.source, tuple(sorted(logit_epilogue.params))))
    logits = "head.logits" if epilogues else graph.output
    graph.add("linear", ("head.norm", "w.lm_head", None), logits, "head")
    for n, (source, params) in enumerate(epilogues):
        out = graph.output if n == len(epilogues) - 1 else f"head.logits{n + 1}"
        graph.add("epilogue", (logits,), out, "head", source=source, params=params)
        logits = out
    return graph


def add_layer(graph: Graph, layer: DecoderLayerBlock) -> None:
    """The ops of one decoder layer, tagged ``L{i}.{part}`` and in block ``L{i}``; the graph keeps ``layer``."""
    i, p = layer.layer, f"L{layer.layer}."
    graph.layers[f"L{i}"] = layer

    def add(kind: str, inputs: tuple[str | None, ...], output: str | None, part: str, **options: Any) -> str:
        graph.add(kind, inputs, output, f"L{i}.{part}", block=f"L{i}", **options)
        return output or ""

    w, d, eps = layer.weight, layer.head_dim, layer.eps
    q_width, kv_width = layer.num_heads * d, layer.num_kv_heads * d
    attn = partial(add, part="attn_in")
    attn("rms_norm", (layer.x, w("attn_norm")), p + "norm1", eps=eps)
    attn("linear", (p + "norm1", w("qkv"), w("qkv_bias")), p + "qkv")
    q = attn("slice_columns", (p + "qkv",), p + "q", start=0, stop=q_width)
    k = attn("slice_columns", (p + "qkv",), p + "k", start=q_width, stop=q_width + kv_width)
    v = attn("slice_columns", (p + "qkv",), p + "v", start=q_width + kv_width, stop=q_width + 2 * kv_width)
    if layer.qk_norm:
        q = attn("rms_norm_heads", (q, w("q_norm")), p + "q_normed", eps=eps, head_dim=d)
        k = attn("rms_norm_heads", (k, w("k_norm")), p + "k_normed", eps=eps, head_dim=d)
    q = attn("rope", (q, layer.positions, layer.inv_freq), p + "q_rot", head_dim=d)
    k = attn("rope", (k, layer.positions, layer.inv_freq), p + "k_rot", head_dim=d)
    graph.attention_inputs[f"L{i}.attn_in"] = AttentionInputRegion(layer, q, k, v)
    add("append_kv", (layer.pool, k, v, layer.slots), None, "attention", layer=i)
    options: dict[str, Any] = {"layer": i, "num_heads": layer.num_heads, "scale": layer.scale}
    if layer.window:
        options["window"] = layer.window
    if layer.softcap:
        options["softcap"] = layer.softcap
    indices = (layer.qo_indptr, layer.kv_page_indices, layer.kv_page_indptr, layer.kv_last_page_lens)
    add("attention", (q, layer.pool, *indices), p + "attn", "attention", **options)
    graph.attentions[f"L{i}.attention"] = AttentionRegion(layer, q, k, v, p + "attn")
    o = add("linear", (p + "attn", w("o"), w("o_bias")), p + "o", "attn_out")
    if layer.post_norms:
        o = add("rms_norm", (o, w("attn_post_norm")), p + "o_normed", "attn_out", eps=eps)
    x = add("add", (o, layer.x), p + "x_attn", "attn_out")
    mlp = partial(add, part="mlp_in")
    mlp("rms_norm", (x, w("mlp_norm")), p + "norm2", eps=eps)
    mlp("linear", (p + "norm2", w("gate_up"), None), p + "gate_up")
    if layer.activation == "silu":
        hidden = mlp("silu_mul", (p + "gate_up",), p + "mlp_hidden")
    else:
        gate = mlp("slice_columns", (p + "gate_up",), p + "gate", start=0, stop=layer.intermediate)
        up = mlp("slice_columns", (p + "gate_up",), p + "up", start=layer.intermediate, stop=2 * layer.intermediate)
        hidden = mlp("epilogue", (gate, up), p + "mlp_hidden", source=GELU_TANH_MUL, params=())
    down = add("linear", (hidden, w("down"), None), p + "down", "mlp_out")
    if layer.post_norms:
        down = add("rms_norm", (down, w("mlp_post_norm")), p + "down_normed", "mlp_out", eps=eps)
    add("add", (down, x), layer.output, "mlp_out")
