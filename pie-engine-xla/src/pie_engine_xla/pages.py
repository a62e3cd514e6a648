"""Copying KV pages between the device pool and the host (offload, tests), and within the pool (copy-on-write).

Page lists are padded to power-of-two buckets like launch arguments, so copying
single pages (copy-on-write) does not compile a new program for every count.
Writes donate the pool and replace the holder's array: an in-place update.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from pie.contract import kv_host_dtype

from pie_engine_xla.tensors import Pad, PoolBuffer, bucket, gathered, pad_host


@cache
def _reader() -> Any:
    import jax

    return jax.jit(lambda pool, ids: pool[:, ids])


@cache
def _writer(sharding: Any) -> Any:
    import jax

    def write(pool: Any, ids: Any, data: Any) -> Any:
        return pool.at[:, ids].set(data, mode="drop")

    return jax.jit(write, donate_argnums=(0,), out_shardings=sharding)


def read_pages(pool: PoolBuffer, page_ids: np.ndarray) -> np.ndarray:
    data = _reader()(pool.array, pad_host(page_ids, Pad.ZEROS))
    return np.array(gathered(data)[:, : len(page_ids)], copy=True)


def write_pages(pool: PoolBuffer, page_ids: np.ndarray, data: np.ndarray) -> None:
    """Write host pages; data of another float type is rounded to the pool's (to nearest even)."""
    count = len(page_ids)
    if count == 0:
        return
    layout = pool.layout
    expected = (layout.num_layers, count, *layout.shape[2:])
    if data.shape != expected:
        raise ValueError(f"page data has shape {data.shape}, expected {expected}")
    padded = np.zeros((layout.num_layers, bucket(count), *layout.shape[2:]), kv_host_dtype(pool.layout.dtype))
    padded[:, :count] = np.asarray(data).astype(padded.dtype, copy=False)
    # Padding ids point past the pool (like padding tokens' slots), so their (zero) rows are dropped.
    pool.array = _writer(pool.sharding)(pool.array, pad_host(page_ids, Pad.SLOTS), padded)


def copy_pages(pool: PoolBuffer, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
    """Pages copied within the pool on the device (copy-on-write), nothing through the host."""
    if len(source_ids) != len(destination_ids):
        raise ValueError(f"copy_pages: {len(source_ids)} source pages for {len(destination_ids)} destinations")
    if len(source_ids) == 0:
        return
    # Padding destinations point past the pool, so the copies into them are dropped.
    pages = _reader()(pool.array, pad_host(source_ids, Pad.ZEROS))
    pool.array = _writer(pool.sharding)(pool.array, pad_host(destination_ids, Pad.SLOTS), pages)
