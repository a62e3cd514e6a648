"""A pass's attention on one GPU: the work items of its plan, uploaded once.

The planning itself is pie-core's (:class:`pie.contract.PassPlan`): the runtime hands the plan over
before the pass (``pie_begin_pass``), and every layer's attention launch reads it from here. A launch
outside a pass (a kernel test, ``pie tune``) is planned from its own batch tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from pie.runtime.pass_plan import key_chunks, query_tiles

SPLIT_CHUNK = 256
"""Keys per split-KV item."""


class PassWork:
    """One pass's attention numbers on a GPU (a :class:`pie.contract.PassPlan`'s, or those of a launch's own batch
    tensors), and the work items uploaded from them, each at most once."""

    __slots__ = ("_upload", "uploaded", "kv_lens", "q_lens", "qo_indptr")

    def __init__(self, qo_indptr: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray, upload: Callable[[np.ndarray], Any]):
        self.qo_indptr, self.q_lens, self.kv_lens = qo_indptr, q_lens, kv_lens
        self._upload = upload
        self.uploaded: dict[tuple[str, int] | tuple[str, int, int], Any] = {}
        """Work items uploaded so far, by kind (``tiles``, ``chunks``), size (and a chunk's window)."""

    def query_tiles(self, block: int) -> Any:
        """The device tensor of :func:`pie.runtime.pass_plan.query_tiles` for tiles of ``block`` tokens."""
        key = ("tiles", block)
        tiles = self.uploaded.get(key)
        if tiles is None:
            tiles = self.uploaded[key] = self._upload(query_tiles(self.qo_indptr, self.q_lens, block))
        return tiles

    def key_chunks(self, chunk: int, window: int = 0) -> tuple[Any, Any]:
        """The device tensors of :func:`pie.runtime.pass_plan.key_chunks` for chunks of ``chunk`` keys (of each
        token's last ``window`` keys, with a sliding window: layers of different windows get their own)."""
        key = ("chunks", chunk, window)
        chunks = self.uploaded.get(key)
        if chunks is None:
            items, item_ptr = key_chunks(self.qo_indptr, self.q_lens, self.kv_lens, chunk, window)
            chunks = self.uploaded[key] = (self._upload(items), self._upload(item_ptr))
        return chunks
