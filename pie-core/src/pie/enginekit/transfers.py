"""Tensor downloads and page reads, writes and copies, written once over a backend's two copy primitives.

A GPU-style engine (Vulkan, WebGPU, Metal) implements ``_read`` and ``_write_regions`` for its buffers and
gets every page hook's bookkeeping (which bytes of the pool each page of each layer is, checks, shapes)
from :class:`HostTransfers`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from pie.enginekit.tensor import GpuTensor


def checked_page_ids(pool_shape: tuple[int, ...], page_ids: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """``page_ids`` as a flat, contiguous array of ``dtype``; an id that is no page of the pool is refused."""
    pages = pool_shape[1]
    ids: np.ndarray = np.ascontiguousarray(page_ids, dtype=dtype).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= pages):
        raise ValueError(f"page ids must lie in [0, {pages}), got {ids.min()}..{ids.max()}")
    return ids


def page_regions(pool_shape: tuple[int, ...], page_ids: np.ndarray, itemsize: int = 4) -> list[tuple[int, int]]:
    """(byte offset in the pool, byte size) of each page of each layer, layer-major like ``pie_read_pages``."""
    layers, pages = pool_shape[0], pool_shape[1]
    page_bytes = int(np.prod(pool_shape[2:])) * itemsize
    ids = checked_page_ids(pool_shape, page_ids)
    return [((layer * pages + int(page)) * page_bytes, page_bytes) for layer in range(layers) for page in ids]


class HostTransfers(ABC):
    """Tensor downloads and page reads/writes, written once over a backend's two copy primitives."""

    @abstractmethod
    def _read(self, ranges: list[tuple[Any, int, int]]) -> np.ndarray:
        """(buffer, byte offset, byte size) ranges copied to the host, concatenated, as uint8 (waits)."""

    @abstractmethod
    def _write_regions(self, buffer: Any, regions: list[tuple[int, int]], host: np.ndarray) -> None:
        """Write ``host`` (uint8, the regions' bytes back to back) into ``buffer`` at (offset, size) regions."""

    def download(self, tensor: GpuTensor) -> np.ndarray:
        if not tensor.nbytes:
            return np.zeros(tensor.shape, tensor.dtype)
        return self._read([(tensor.buffer, 0, tensor.nbytes)]).view(tensor.dtype).reshape(tensor.shape)

    def read_pages(self, pool: GpuTensor, page_ids: np.ndarray) -> np.ndarray:
        """The pages of every layer, ``[layers, len(page_ids), 2, page_size, heads, dim]`` of the pool's type."""
        regions = page_regions(pool.shape, page_ids, pool.dtype.itemsize)
        shape = (pool.shape[0], len(np.asarray(page_ids).ravel()), *pool.shape[2:])
        if not regions:
            return np.zeros(shape, pool.dtype)
        return self._read([(pool.buffer, offset, size) for offset, size in regions]).view(pool.dtype).reshape(shape)

    def write_pages(self, pool: GpuTensor, page_ids: np.ndarray, data: np.ndarray) -> None:
        """Write pages shaped as :meth:`read_pages` returns them, an array of the pool's type."""
        data = np.asarray(data)
        if data.dtype != pool.dtype:
            raise ValueError(f"write_pages: the pool holds {pool.dtype.name}, the pages given are {data.dtype.name}")
        regions = page_regions(pool.shape, page_ids, pool.dtype.itemsize)
        host = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        expected = sum(size for _, size in regions)
        if host.nbytes != expected:
            raise ValueError(
                f"write_pages: got {host.nbytes} bytes for {len(regions)} pages of {expected // max(len(regions), 1)}"
            )
        if regions:
            self._write_regions(pool.buffer, regions, host)

    def copy_pages(self, pool: GpuTensor, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        itemsize = pool.dtype.itemsize
        sources = page_regions(pool.shape, source_ids, itemsize)
        destinations = page_regions(pool.shape, destination_ids, itemsize)
        if len(sources) != len(destinations):
            raise ValueError(f"copy_pages: {len(sources)} source regions for {len(destinations)} destinations")
        if sources:
            self._copy_within(pool.buffer, [(s, d, size) for (s, size), (d, _) in zip(sources, destinations)])

    def _copy_within(self, buffer: Any, copies: list[tuple[int, int, int]]) -> None:
        """Copy (source offset, destination offset, size) regions of ``buffer``, none overlapping another.

        Through the host here; a backend that can copy on the device overrides it."""
        host = self._read([(buffer, source, size) for source, _, size in copies])
        self._write_regions(buffer, [(destination, size) for _, destination, size in copies], host)
