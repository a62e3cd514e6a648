"""The catalogue's ``top_k`` on this engine: each row's k best logits and their indices, on the device.

A top-k sampler needs only those few candidates, so ``Device.top_tokens`` downloads ``[rows, k]``
numbers instead of the whole vocabulary per sequence. The kernel (``csrc/sampling.cu``, in the
``core`` unit) runs one block of 256 threads per row and keeps the candidates in shared memory,
hence at most :data:`MAX_K` of them.
"""

from __future__ import annotations

from pie.contract import KernelRequest, Launcher

from pie_engine_cuda import launch as configs
from pie_engine_cuda.args import TopKArgs
from pie_engine_cuda.runtime import GpuDevice
from pie_engine_cuda.tensor import DeviceTensor

MAX_K = 256
"""PIE_TOPK_MAX in sampling.cu: the candidates one block sorts in shared memory."""


def make_top_k(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """(values float32, indices int32) ``[rows, k]``, best first, ties to the lower index; NaN is skipped,
    and a row with fewer than k numbers pads with index -1 and value -inf."""
    k = int(request.option("k"))
    if not 1 <= k <= MAX_K:
        raise ValueError(f"top_k on the CUDA engine needs 1 <= k <= {MAX_K}, not k={k}")
    args = TopKArgs()
    args.k = k
    launch = rt.bind("core", "pie_top_k", args)
    empty, per_row = rt.empty, configs.per_row

    def top_k(logits: DeviceTensor) -> tuple[DeviceTensor, DeviceTensor]:
        rows, cols = logits.shape
        if k > cols:
            raise ValueError(f"top_k: k={k} exceeds the row's {cols} columns")
        values, indices = empty((rows, k)), empty((rows, k), "int32")
        if rows:
            args.x, args.values, args.indices, args.rows, args.cols = logits.ptr, values.ptr, indices.ptr, rows, cols
            launch(*per_row(rows))
        return values, indices

    return top_k
