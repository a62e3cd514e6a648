"""The native decoder layers against the layer their description (`pie.contract.DecoderLayerBlock`) states,
computed by the reference kernels (`pie.kernels`): Gemma 2-, Gemma 3- and Mistral-like layers (sliding
windows, soft-capped scores, Q/K norms, post-norms, GELU), on float32 and stored weights, for decode batches
of one and several sequences whose cached context is shorter and longer than the window."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pie import kernels as reference
from pie.contract import DecoderLayerBlock, RegionRequest
from pie.models.decoder import GELU_TANH_MUL
from pie.weights import StoredWeight, quantize
from pie_engine_cpu import native
from pie_engine_cpu.layers import compile_block, compile_stack

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE, WINDOW = 64, 96, 4, 2, 16, 4, 6
MATRICES = ("qkv", "o", "gate_up", "down")
LAYERS = {
    "gemma2": {"window": WINDOW, "softcap": 1.5, "post_norms": True, "activation": "gelu_tanh"},
    "gemma3": {"window": WINDOW, "qk_norm": True, "post_norms": True, "activation": "gelu_tanh"},
    "mistral": {"window": WINDOW},
}
"""Each family's options, for a layer of the sizes above."""
CONTEXTS = {"one-short": [3], "one-long": [13], "several": [2, 5, 9, 13]}
"""The cached tokens of each sequence of a decode batch, before its new one: windows of 6 cut the longer ones."""
TOLERANCE = {"f32": 1e-4, "f16": 1e-4, "q8_0": 5e-4}
"""The stored types' projections take integer activations (`native.ACTIVATIONS`), q8_0's within 5e-4 here."""


def _layer(index: int, window: int = 0, softcap: float = 0.0, qk_norm: bool = False, post_norms: bool = False,
           activation: str = "silu", inv_freq: str = "inv_freq") -> DecoderLayerBlock:
    roles = ("attn_norm", "qkv", *(("q_norm", "k_norm") if qk_norm else ()), "o",
             *(("attn_post_norm",) if post_norms else ()), "mlp_norm", "gate_up", "down",
             *(("mlp_post_norm",) if post_norms else ()))
    return DecoderLayerBlock(
        layer=index, weights=tuple((role, f"w.L{index}.{role}") for role in roles),
        x="x" if index == 0 else f"L{index - 1}.x_out", output=f"L{index}.x_out", pool="pool",
        positions="positions", inv_freq=inv_freq, slots="slots", qo_indptr="qo", kv_page_indices="indices",
        kv_page_indptr="indptr", kv_last_page_lens="last", hidden=HIDDEN, intermediate=INTER, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=1e-6, scale=HEAD_DIM**-0.5, qk_norm=qk_norm, window=window,
        softcap=softcap, post_norms=post_norms, activation=activation,  # type: ignore[arg-type]
    )


PASS_INPUTS = ("pool", "positions", "inv_freq", "inv_freq_local", "slots", "qo", "indices", "indptr", "last")


def _request(layers: tuple[DecoderLayerBlock, ...]) -> RegionRequest:
    """The block of one layer, or the stack of several, reading every pass input and each layer's weights."""
    inputs = (layers[0].x, *PASS_INPUTS, *(name for layer in layers for _, name in layer.weights))
    label = f"L{layers[0].layer}" + (f"-L{layers[-1].layer}" if len(layers) > 1 else "")
    return RegionRequest(label, (), inputs, (layers[-1].output,), layer=layers[0] if len(layers) == 1 else None)


def _values(layers: tuple[DecoderLayerBlock, ...], contexts: list[int], weight_type: str, seed: int = 0) -> dict:
    """Random inputs of a decode pass: one new row per sequence after its ``contexts[b]`` cached tokens (random
    keys and values in shuffled pages), the matrices in ``weight_type``."""
    rng = np.random.default_rng(seed)
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"attn_norm": (HIDDEN,), "qkv": (q_width + 2 * kv_width, HIDDEN), "q_norm": (HEAD_DIM,),
              "k_norm": (HEAD_DIM,), "o": (HIDDEN, q_width), "attn_post_norm": (HIDDEN,), "mlp_norm": (HIDDEN,),
              "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER), "mlp_post_norm": (HIDDEN,)}
    values: dict = {}
    for layer in layers:
        for role, name in layer.weights:
            if role in MATRICES:  # qkv weights large enough that scores reach the soft cap
                scale = 0.4 if role == "qkv" else 0.1
                values[name] = quantize(scale * rng.standard_normal(shapes[role]).astype(np.float32), weight_type)
            else:
                values[name] = (1 + 0.2 * rng.standard_normal(shapes[role])).astype(np.float32)
    page_counts = [(n + 1 + PAGE - 1) // PAGE for n in contexts]
    pages = rng.permutation(sum(page_counts) + 2).astype(np.int32)
    indptr = np.concatenate(([0], np.cumsum(page_counts))).astype(np.int32)
    pool = np.zeros((len(layers), len(pages), 2, PAGE, KV_HEADS, HEAD_DIM), dtype=np.float32)
    for b, n in enumerate(contexts):  # the cached tokens, position t at page t // PAGE of the sequence
        for t in range(n):
            pool[:, pages[indptr[b] + t // PAGE], :, t % PAGE] = rng.standard_normal((len(layers), 2, KV_HEADS, HEAD_DIM))
    positions = np.array(contexts, dtype=np.int32)
    frequencies = {"inv_freq": 1e6, "inv_freq_local": 1e4}
    values.update(
        {name: (1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32)
         for name, theta in frequencies.items()},
        x=rng.standard_normal((len(contexts), HIDDEN)).astype(np.float32), pool=pool, positions=positions,
        slots=np.array([pages[indptr[b] + n // PAGE] * PAGE + n % PAGE for b, n in enumerate(contexts)], np.int32),
        qo=np.arange(len(contexts) + 1, dtype=np.int32), indices=pages[: indptr[-1]].copy(), indptr=indptr,
        last=np.array([n % PAGE + 1 for n in contexts], dtype=np.int32),
    )
    return values


def _reference(layers: tuple[DecoderLayerBlock, ...], values: dict) -> tuple[np.ndarray, np.ndarray]:
    """The layers as `DecoderLayerBlock` states them, kernel by kernel, on the dequantized weights: the output
    and the pool with each layer's new keys and values."""
    pool, x = values["pool"].copy(), values["x"]
    indices = tuple(values[name] for name in ("qo", "indices", "indptr", "last"))
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer in layers:
        weights = {role: values[name] for role, name in layer.weights}
        w = {role: weight.dequantize() if isinstance(weight, StoredWeight) else weight for role, weight in weights.items()}
        eps = layer.eps
        qkv = reference.linear(reference.rms_norm(x, w["attn_norm"], eps=eps), w["qkv"], w.get("qkv_bias"))
        q, k, v = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width], qkv[:, q_width + kv_width :]
        if layer.qk_norm:
            q = reference.rms_norm_heads(q, w["q_norm"], eps=eps, head_dim=HEAD_DIM)
            k = reference.rms_norm_heads(k, w["k_norm"], eps=eps, head_dim=HEAD_DIM)
        inv_freq = values[layer.inv_freq]
        q = reference.rope(q, values["positions"], inv_freq, head_dim=HEAD_DIM)
        k = reference.rope(k, values["positions"], inv_freq, head_dim=HEAD_DIM)
        reference.append_kv(pool, k, v, values["slots"], layer=layer.layer)
        a = reference.attention(q, pool, *indices, layer=layer.layer, num_heads=HEADS, scale=layer.scale,
                                window=layer.window, softcap=layer.softcap)
        o = reference.linear(a, w["o"], w.get("o_bias"))
        x = reference.add(x, reference.rms_norm(o, w["attn_post_norm"], eps=eps) if layer.post_norms else o)
        gate_up = reference.linear(reference.rms_norm(x, w["mlp_norm"], eps=eps), w["gate_up"])
        if layer.activation == "silu":
            gated = reference.silu_mul(gate_up)
        else:
            gated = reference.epilogue(gate_up[:, :INTER], gate_up[:, INTER:], source=GELU_TANH_MUL)
        down = reference.linear(gated, w["down"])
        x = reference.add(x, reference.rms_norm(down, w["mlp_post_norm"], eps=eps) if layer.post_norms else down)
    return x, pool


def _launch(launcher, request: RegionRequest, values: dict) -> tuple[np.ndarray, np.ndarray]:
    """The launcher's output and the pool it appended to (a copy of the inputs' own)."""
    pool = values["pool"].copy()
    given = {**values, "pool": pool, request.inputs[0]: values["x"]}
    (out,) = launcher(*(given[name] for name in request.inputs))
    return out, pool


@pytest.mark.parametrize("contexts", list(CONTEXTS.values()), ids=list(CONTEXTS))
@pytest.mark.parametrize("weight_type", list(TOLERANCE))
@pytest.mark.parametrize("family", list(LAYERS))
def test_a_native_layer_is_the_layer_its_description_states(
    compiled: native.NativeKernels, family: str, weight_type: str, contexts: list[int]
) -> None:
    layer = _layer(0, **LAYERS[family])
    request, values = _request((layer,)), _values((layer,), contexts, weight_type)
    launcher = compile_block(request)
    assert launcher is not None, "the native call runs every option of the family's layer"
    got, pool = _launch(launcher, request, values)
    expected, expected_pool = _reference((layer,), values)
    tolerance = TOLERANCE[weight_type]
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(pool, expected_pool, rtol=tolerance, atol=tolerance)
    # The options bite: without each, the reference is another layer than the one the native call ran.
    off = {"softcap": 0.0, "post_norms": False, "activation": "silu"}
    if max(contexts) + 1 > WINDOW:
        off["window"] = 0
    for option, value in off.items():
        if getattr(layer, option) != value:
            other, _ = _reference((replace(layer, **{option: value}),), values)
            assert np.abs(other - got).max() > 10 * tolerance, option


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_and_global_layers_run_as_one_stack(compiled: native.NativeKernels, family: str) -> None:
    """Gemma's layers alternate a window with none; Gemma 3's rotate with other frequencies in each."""
    options = LAYERS[family]
    layers = tuple(
        _layer(i, **{**options, "window": WINDOW if i % 2 == 0 else 0},
               inv_freq="inv_freq_local" if family == "gemma3" and i % 2 == 0 else "inv_freq")
        for i in range(3)
    )
    request = _request(layers)
    blocks = tuple(_request((layer,)) for layer in layers)
    launcher = compile_stack(request, blocks)
    assert launcher is not None
    for contexts in CONTEXTS.values():
        values = _values(layers, contexts, "f32", seed=len(contexts))
        got, pool = _launch(launcher, request, values)
        expected, expected_pool = _reference(layers, values)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(pool, expected_pool, rtol=1e-4, atol=1e-4)
    if family == "gemma3":  # each layer its own tables: one table for all would be another model
        shared = tuple(replace(layer, inv_freq="inv_freq") for layer in layers)
        other, _ = _reference(shared, values)
        assert np.abs(other - got).max() > 1e-3
