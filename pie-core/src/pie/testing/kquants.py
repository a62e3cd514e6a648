"""K-quant weights for tests: the ``gguf`` library reads Q4_K, Q5_K and Q6_K but cannot write them.

:func:`quantize_k` is a plain round-to-nearest quantizer (llama.cpp's searches its scales; tests only
need valid blocks near the input), :func:`random_blocks` random valid blocks of any block type pie
carries. Both give a :class:`pie.weights.StoredWeight`, checked by the library's own dequantization.
"""

from __future__ import annotations

import numpy as np

from pie.weights import WEIGHT_TYPES, StoredWeight, row_bytes

K_TYPES = ("q4_k", "q5_k", "q6_k")
GROUP = 32
"""Elements of a Q4_K/Q5_K group: one 6-bit scale and minimum each (Q6_K scales halves of 16)."""


def quantize_k(array: np.ndarray, weight_type: str) -> StoredWeight:
    """A float matrix as ``q4_k``, ``q5_k`` or ``q6_k`` (columns a multiple of 256), rounded to nearest."""
    if weight_type not in K_TYPES:
        raise ValueError(f"quantize_k writes {', '.join(K_TYPES)}, not {weight_type!r}")
    array = np.asarray(array, dtype=np.float32)
    rows, cols = array.shape
    row_bytes(weight_type, cols)  # checks whole super-blocks
    blocks = array.reshape(-1, 256)
    packed = _q6_k(blocks) if weight_type == "q6_k" else _q45_k(blocks, 15 if weight_type == "q4_k" else 31)
    return StoredWeight(weight_type, (rows, cols), np.ascontiguousarray(packed).reshape(rows, -1))


def random_blocks(rng: np.random.Generator, weight_type: str, rows: int, cols: int) -> StoredWeight:
    """Random valid blocks: random bytes, with every float16 field (d, dmin) a finite value below 0.01."""
    _, block, size = WEIGHT_TYPES[weight_type]
    if block == 1:
        raise ValueError(f"random_blocks makes block types, not {weight_type!r}")
    row_bytes(weight_type, cols)  # checks whole blocks
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    fields = {"q6_k": (208,), "q4_k": (0, 2), "q5_k": (0, 2), "q4_1": (0, 2)}.get(weight_type, (0,))
    for offset in fields:
        scale = (rng.uniform(-0.01, 0.01, len(data)) if offset == 0 or weight_type == "q6_k"
                 else rng.uniform(0, 0.01, len(data)))
        data[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return StoredWeight(weight_type, (rows, cols), data.reshape(rows, -1))


def _q45_k(blocks: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (top 15) or Q5_K (top 31) blocks: per group x ~ d sc q - dmin m, sc and m of 6 bits."""
    count = len(blocks)
    groups = blocks.reshape(count, 8, GROUP)
    low = np.minimum(groups.min(axis=2), 0)
    step = (groups.max(axis=2) - low) / top
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = (-low.min(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    scales = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63).astype(np.uint8)
    minima = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    group_step = (d32 * scales)[:, :, None]
    shifted = groups + (dmin32 * minima)[:, :, None]
    q = np.clip(np.rint(np.divide(shifted, group_step, out=np.zeros_like(shifted), where=group_step > 0)), 0, top)
    q = q.astype(np.uint8)
    packed_scales = np.concatenate([
        (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6),
        (minima[:, :4] & 63) | ((minima[:, 4:] >> 4) << 6),
        (scales[:, 4:] & 15) | ((minima[:, 4:] & 15) << 4),
    ], axis=1)
    pairs = q.reshape(count, 4, 2, GROUP)
    nibbles = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(count, 128)
    parts = [d.view(np.uint8).reshape(count, 2), dmin.view(np.uint8).reshape(count, 2), packed_scales]
    if top == 31:
        fifth = (q >> 4) & 1  # [count, 8 groups, 32]: bit g of byte i
        parts.append((fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
    return np.concatenate([*parts, nibbles], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks: per 16 elements x ~ d sc (q - 32), sc an int8."""
    count = len(blocks)
    halves = blocks.reshape(count, 16, 16)
    step = np.abs(halves).max(axis=2) / 32
    d = (step.max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    scales = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 127).astype(np.int8)
    group_step = (d32 * scales)[:, :, None]
    q = np.rint(np.divide(halves, group_step, out=np.zeros_like(halves), where=group_step > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(count, 2, 4, GROUP)  # [half, group k, element]
    low = (q[:, :, :2] & 15) | ((q[:, :, 2:] & 15) << 4)  # groups 0-1 low nibbles, 2-3 high
    high = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4)).astype(np.uint8)
    return np.concatenate([
        low.reshape(count, 128), high.reshape(count, 64), scales.view(np.uint8), d.view(np.uint8).reshape(count, 2),
    ], axis=1)
