"""numpy kernels of the CPU engine, float32 throughout.

Every kernel keeps float32: a float64 operand anywhere would silently make
the matmuls several times slower. Python float scalars are fine (numpy treats
them as weak), numpy float64 scalars are not, so eps and scales are converted
once when a kernel is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

F32 = np.float32


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    return table[ids]


def make_rms_norm(eps: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    eps32 = F32(eps)

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        mean_square = np.einsum("td,td->t", x, x)[:, None] / F32(x.shape[-1])
        return x * (weight / np.sqrt(mean_square + eps32))

    return rms_norm


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = x @ weight.T
    if bias is not None:
        y += bias
    return y


def linear_rows(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """One GEMV per token row: avoids GEMM packing for tiny batches."""
    y = np.empty((x.shape[0], weight.shape[0]), dtype=F32)
    for row in range(x.shape[0]):
        np.dot(weight, x[row], out=y[row])
    if bias is not None:
        y += bias
    return y


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def make_slice_columns(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    def slice_columns(x: np.ndarray) -> np.ndarray:
        return x[:, start:stop]

    return slice_columns


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    half = gate_up.shape[-1] // 2
    gate = gate_up[:, :half]
    return gate / (F32(1) + np.exp(-gate)) * gate_up[:, half:]


def make_rope(head_dim: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    half = head_dim // 2

    def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        tokens = x.shape[0]
        angles = positions.astype(F32)[:, None] * inv_freq[None, :]
        cos = np.cos(angles)[:, None, :]
        sin = np.sin(angles)[:, None, :]
        heads = x.reshape(tokens, -1, head_dim)
        first, second = heads[..., :half], heads[..., half:]
        out = np.empty_like(heads)
        out[..., :half] = first * cos - second * sin
        out[..., half:] = second * cos + first * sin
        return out.reshape(tokens, -1)

    return rope


def make_append_kv(layer: int) -> Callable[..., None]:
    def append_kv(pool: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        page_size, kv_heads, head_dim = pool.shape[3:]
        pages, offsets = np.divmod(slots, page_size)
        layer_pool = pool[layer]
        layer_pool[pages, 0, offsets] = k.reshape(-1, kv_heads, head_dim)
        layer_pool[pages, 1, offsets] = v.reshape(-1, kv_heads, head_dim)

    return append_kv


def make_attention(layer: int, num_heads: int, scale: float) -> Callable[..., np.ndarray]:
    scale32 = F32(scale)

    def attention(
        q: np.ndarray,
        pool: np.ndarray,
        qo_indptr: np.ndarray,
        kv_page_indices: np.ndarray,
        kv_page_indptr: np.ndarray,
        kv_last_page_lens: np.ndarray,
    ) -> np.ndarray:
        page_size, kv_heads, head_dim = pool.shape[3:]
        group = num_heads // kv_heads
        layer_pool = pool[layer]
        out = np.empty((q.shape[0], num_heads * head_dim), dtype=F32)
        for b in range(len(qo_indptr) - 1):
            start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
            if start == stop:
                continue
            pages = kv_page_indices[kv_page_indptr[b] : kv_page_indptr[b + 1]]
            kv_len = (len(pages) - 1) * page_size + int(kv_last_page_lens[b])
            kv = layer_pool[pages]  # [n, 2, page_size, kv_heads, head_dim]
            keys = kv[:, 0].reshape(-1, kv_heads, head_dim)[:kv_len].transpose(1, 2, 0)  # [Hkv, d, L]
            values = kv[:, 1].reshape(-1, kv_heads, head_dim)[:kv_len].transpose(1, 0, 2)  # [Hkv, L, d]
            q_len = stop - start
            queries = q[start:stop].reshape(q_len, kv_heads, group, head_dim).transpose(1, 2, 0, 3)
            scores = (queries * scale32) @ keys[:, None]  # [Hkv, group, q_len, L]
            if q_len > 1:
                rows = np.arange(q_len)[:, None] + (kv_len - q_len)
                scores = np.where(np.arange(kv_len)[None, :] > rows, F32(-np.inf), scores)
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            context = weights @ values[:, None]  # [Hkv, group, q_len, d]
            out[start:stop] = context.transpose(2, 0, 1, 3).reshape(q_len, -1)
        return out

    return attention


def gather_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return x[rows]


def argmax(x: np.ndarray) -> np.ndarray:
    return np.argmax(x, axis=-1).astype(np.int32)


def make_softmax(temperature: float) -> Callable[[np.ndarray], np.ndarray]:
    inverse = F32(1.0 / temperature)

    def softmax(x: np.ndarray) -> np.ndarray:
        z = x * inverse
        z = np.exp(z - z.max(axis=-1, keepdims=True))
        z /= z.sum(axis=-1, keepdims=True)
        return z

    return softmax


def make_rms_norm_linear(eps: float) -> Callable[..., np.ndarray]:
    rms_norm = make_rms_norm(eps)

    def rms_norm_linear(
        x: np.ndarray, norm_weight: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None
    ) -> np.ndarray:
        return linear(rms_norm(x, norm_weight), weight, bias)

    return rms_norm_linear


def linear_add(x: np.ndarray, weight: np.ndarray, residual: np.ndarray) -> np.ndarray:
    y = x @ weight.T
    y += residual
    return y


def make_rms_norm_gate_up_silu(eps: float) -> Callable[..., np.ndarray]:
    rms_norm = make_rms_norm(eps)

    def rms_norm_gate_up_silu(x: np.ndarray, norm_weight: np.ndarray, gate_up: np.ndarray) -> np.ndarray:
        return silu_mul(rms_norm(x, norm_weight) @ gate_up.T)

    return rms_norm_gate_up_silu
