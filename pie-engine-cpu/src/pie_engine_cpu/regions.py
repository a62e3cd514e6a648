"""Whole regions the CPU engine runs as one native call.

Every launch costs the plan loop and a ctypes call, a few microseconds once the caches are full of
weights, a sizeable share of a batch-1 decode step. The attention input region (RMSNorm, the QKV
projection, three column slices and two RoPEs: seven launches) is the longest run of small ones, so
for decode sizes it becomes one call, read from the region's description (`AttentionInputRegion`), not
its ops; larger token counts run its kernels one by one, BLAS projection included, as lowering would
have. The attention region (append_kv, attention) becomes one launch of the two native kernels, read from
its description (`AttentionRegion`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from pie.contract import AttentionRegion, RegionRequest
from pie.enginekit.regions import AttentionInputSignature, attention_input_signature

from pie_engine_cpu import kernels, native


def compile_region(region: RegionRequest) -> Callable[..., tuple[Any, ...]] | None:
    """A launcher for ``region`` when it is one the engine fuses, else None (lowered kernel by kernel)."""
    signature = attention_input_signature(region)
    if signature is not None:
        return _attention_input(signature)
    if region.attention is not None:
        return _attention(region, region.attention)
    return None


def _attention_input(at: AttentionInputSignature) -> Callable[..., tuple[Any, ...]]:
    """The region as ``pie_rms_norm_qkv_rope`` for decode sizes; more rows run its kernels, BLAS projection
    included."""
    head_dim, eps, q_width, kv_width = at.layer.head_dim, at.layer.eps, at.q_width, at.kv_width
    fused, max_rows = native.load().rms_norm_qkv_rope, native.load().max_rows
    norm_pinned, weight_pinned, bias_pinned = native.Pinned(), native.Pinned(), native.Pinned()
    q_norm_pinned, k_norm_pinned = native.Pinned(), native.Pinned()
    norm_heads = kernels.make_rms_norm_heads(eps, head_dim)
    project = kernels.make_rms_norm_linear(eps)
    rope = native.make_rope(head_dim)

    def attention_input(*args: Any) -> tuple[Any, ...]:
        x, norm, weight = args[at.x], args[at.norm], args[at.weight]
        bias = None if at.bias is None else args[at.bias]
        positions, inv_freq = args[at.positions], args[at.inv_freq]
        tokens = x.shape[0]
        q_norm = None if at.q_norm is None else args[at.q_norm]
        k_norm = None if at.k_norm is None else args[at.k_norm]
        if tokens > max_rows:
            qkv = project(x, norm, weight, bias)
            q, k = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]
            if q_norm is not None:
                q, k = norm_heads(q, q_norm), norm_heads(k, k_norm)
            return at.outputs((rope(q, positions, inv_freq), rope(k, positions, inv_freq), qkv[:, q_width + kv_width :]))
        x = native.float32_rows(x)
        tables = kernels.rope_tables(positions, inv_freq)
        q = np.empty((tokens, q_width), dtype=np.float32)
        k = np.empty((tokens, kv_width), dtype=np.float32)
        v = np.empty((tokens, kv_width), dtype=np.float32)
        pointer = weight_pinned(weight)
        status = fused(
            native.address(x), norm_pinned(norm), eps, pointer, weight_pinned.type, bias_pinned(bias),
            q_norm_pinned(q_norm), k_norm_pinned(k_norm),
            native.address(tables.cos_by_token), native.address(tables.sin_by_token),
            native.address(q), native.address(k), native.address(v),
            tokens, q_width, kv_width, weight.shape[1], head_dim,
        )
        native.checked(status)
        return at.outputs((q, k, v))

    return attention_input


def _attention(region: RegionRequest, described: AttentionRegion) -> Callable[..., tuple[Any, ...]]:
    """append_kv then attention as one launch: the two native kernels back to back."""
    layer = described.layer
    position: dict[str, int] = {name: index for index, name in enumerate(region.inputs)}
    append_at = [position[name] for name in (layer.pool, described.k, described.v, layer.slots)]
    indices = (layer.qo_indptr, layer.kv_page_indices, layer.kv_page_indptr, layer.kv_last_page_lens)
    attend_at = [position[name] for name in (described.q, layer.pool, *indices)]
    append_kv = native.make_append_kv(layer.layer)
    attention = native.make_attention(layer.layer, layer.num_heads, layer.scale, layer.window, layer.softcap)

    def append_and_attend(*args: Any) -> tuple[Any, ...]:
        append_kv(*[args[i] for i in append_at])
        return (attention(*[args[i] for i in attend_at]),)

    return append_and_attend
