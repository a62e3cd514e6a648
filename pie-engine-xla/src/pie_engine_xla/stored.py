"""Weights kept on the device in their file's type and widened to float32 inside the jitted region.

A 16-bit weight lives as a float16 or bfloat16 array of its logical shape. A block-quantized weight
lives as its stored bytes, uint8 ``[rows, row_bytes]`` (see :class:`pie.weights.StoredWeight`): rows
are whole blocks, so the tensor-parallel layout permutes and shards byte rows, and shards byte columns
at block boundaries. The decoders below unpack the blocks with integer bit operations and read the
float16 scales by bitcasting byte pairs, all inside the region's one program. Layouts are
those of ``gguf.quants`` (the conformance kit checks every type against it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax
from pie.weights import WEIGHT_TYPES


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored weight inside a traced region: the device array, its type and its logical columns."""

    array: Any
    type: str
    columns: int

    def dense(self) -> Any:
        """The whole matrix in float32."""
        return widen(self.array, self.type, self.columns)

    def take(self, ids: Any) -> Any:
        """Rows ``ids`` (clipped) in float32, decoding only those rows."""
        return widen(jnp.take(self.array, ids, axis=0, mode="clip"), self.type, self.columns)


def widen(array: Any, weight_type: str, columns: int) -> Any:
    """``array`` (rows of ``weight_type``) as float32 ``[..., columns]``."""
    if weight_type in ("f16", "bf16"):
        return array.astype(jnp.float32)
    _, block, size = WEIGHT_TYPES[weight_type]
    lead = array.shape[:-1]
    blocks = array.reshape(*lead, columns // block, size)
    return _DECODERS[weight_type](blocks).reshape(*lead, columns)


def _half(blocks: Any, at: int) -> Any:
    """The float16 at byte ``at`` of every block, as float32 ``[..., blocks, 1]``."""
    bits = blocks[..., at].astype(jnp.uint16) | (blocks[..., at + 1].astype(jnp.uint16) << 8)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(packed: Any) -> Any:
    """Bytes ``[..., n]`` as their low nibbles then their high nibbles, ``[..., 2n]`` (uint8)."""
    return jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q8_0(blocks: Any) -> Any:
    return _half(blocks, 0) * lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)


def _q4_0(blocks: Any) -> Any:
    return _half(blocks, 0) * (_nibbles(blocks[..., 2:]).astype(jnp.float32) - 8.0)


def _q4_1(blocks: Any) -> Any:
    return _half(blocks, 0) * _nibbles(blocks[..., 4:]).astype(jnp.float32) + _half(blocks, 2)


def _q5_0(blocks: Any) -> Any:
    high = blocks[..., 2:6].astype(jnp.uint32)
    word = high[..., 0] | (high[..., 1] << 8) | (high[..., 2] << 16) | (high[..., 3] << 24)
    fifth = ((word[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
    quants = _nibbles(blocks[..., 6:]) | (fifth << 4)
    return _half(blocks, 0) * (quants.astype(jnp.float32) - 16.0)


def _k_scales(packed: Any) -> tuple[Any, Any]:
    """The eight 6-bit scales and minimums of a Q4_K/Q5_K super-block from its 12 bytes, ``[..., 8]`` each."""
    low, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = jnp.concatenate([low & 0x3F, (top & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    minimums = jnp.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return scales.astype(jnp.float32), minimums.astype(jnp.float32)


def _k_groups(quants: Any, d: Any, dmin: Any, packed_scales: Any) -> Any:
    """``d·scale·q − dmin·min`` over a super-block's eight groups of 32 (``quants``: ``[..., 8, 32]``)."""
    scales, minimums = _k_scales(packed_scales)
    lead = quants.shape[:-2]
    values = (d * scales)[..., None] * quants.astype(jnp.float32) - (dmin * minimums)[..., None]
    return values.reshape(*lead, 256)


def _low_high_groups(packed: Any) -> Any:
    """128 bytes of nibbles as eight groups of 32: groups 2j and 2j+1 are the low and high nibbles of
    bytes 32j..32j+31."""
    chunks = packed.reshape(*packed.shape[:-1], 4, 32)
    return jnp.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*packed.shape[:-1], 8, 32)


def _q4_k(blocks: Any) -> Any:
    return _k_groups(_low_high_groups(blocks[..., 16:144]), _half(blocks, 0), _half(blocks, 2), blocks[..., 4:16])


def _q5_k(blocks: Any) -> Any:
    high = blocks[..., 16:48]
    fifth = (high[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
    quants = _low_high_groups(blocks[..., 48:176]) | (fifth << 4)
    return _k_groups(quants, _half(blocks, 0), _half(blocks, 2), blocks[..., 4:16])


def _q6_k(blocks: Any) -> Any:
    lead = blocks.shape[:-1]
    low = blocks[..., 0:128].reshape(*lead, 2, 1, 64) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(*lead, 8, 32)
    top = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
    top = (top & 0x03).reshape(*lead, 8, 32)
    quants = (low | (top << 4)).astype(jnp.float32) - 32.0
    scales = lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)
    factors = (_half(blocks, 208) * scales)[..., None]
    return (factors * quants.reshape(*lead, 16, 16)).reshape(*lead, 256)


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
}
"""Each block type's decoder: uint8 ``[..., blocks, block_bytes]`` to float32 ``[..., blocks, elements]``."""
