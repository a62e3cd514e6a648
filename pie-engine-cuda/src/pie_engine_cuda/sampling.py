"""Sampling helpers on the device: the top-k candidates of each row of logits.

A top-k or top-p sampler only needs the few best logits; downloading those instead of a
whole vocabulary per sequence keeps the step's device-to-host traffic small. The catalogue
has no sampling kernel yet, so this is the engine's own API::

    values, indices = top_k(device.info, logits, 50)   # [rows, 50] each, best first
"""

from __future__ import annotations

from pie.contract import DeviceInfo

from pie_engine_cuda import launch as configs
from pie_engine_cuda.args import TopKArgs
from pie_engine_cuda.runtime import GpuDevice
from pie_engine_cuda.tensor import DeviceTensor

MAX_K = 256


class TopK:
    """pie_top_k bound to a device: (values float32, indices int32), ties to the lower index."""

    def __init__(self, rt: GpuDevice):
        self.rt = rt
        self.args = TopKArgs()
        self._launch = rt.bind("core", "pie_top_k", self.args)

    def __call__(self, logits: DeviceTensor, k: int) -> tuple[DeviceTensor, DeviceTensor]:
        rows, cols = logits.shape
        if not 1 <= k <= min(cols, MAX_K):
            raise ValueError(f"top_k needs 1 <= k <= min(columns, {MAX_K}); got k={k} for {cols} columns")
        values = self.rt.empty((rows, k))
        indices = self.rt.empty((rows, k), "int32")
        if rows:
            a = self.args
            a.x, a.values, a.indices, a.rows, a.cols, a.k = logits.ptr, values.ptr, indices.ptr, rows, cols, k
            self._launch(*configs.per_row(rows))
        return values, indices


_bound: dict[int, TopK] = {}


def top_k(device: DeviceInfo, logits: DeviceTensor, k: int) -> tuple[DeviceTensor, DeviceTensor]:
    """Each row's k largest logits and their indices, best first (NaN skipped; indices -1 pad
    rows with fewer than k numbers)."""
    from pie_engine_cuda.plugin import _runtime

    rt = _runtime(device)
    bound = _bound.get(id(rt))
    if bound is None or bound.rt is not rt:
        bound = _bound[id(rt)] = TopK(rt)
    return bound(logits, k)
