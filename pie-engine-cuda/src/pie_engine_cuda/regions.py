"""Whole regions the CUDA engine runs in fewer launches than their kernels.

A launch costs the host several microseconds of Python and driver, and at batch 1 a decode step is
bound by them, not by the GPU. The attention input region (RMSNorm, the QKV projection, three column
slices, two RoPEs: six launches once the norm is fused into the projection) becomes two: the
projection, and one kernel that splits its rows into q, k and v and rotates q and k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pie.contract import RegionRequest
from pie.poem.patterns import AttentionInput

from pie_engine_cuda import launch as configs
from pie_engine_cuda.args import QkvRopeArgs
from pie_engine_cuda.launchers import Projection
from pie_engine_cuda.runtime import GpuDevice
from pie_engine_cuda.tensor import DeviceTensor


def compile_region(rt: GpuDevice, region: RegionRequest) -> Callable[..., tuple[DeviceTensor, ...]] | None:
    """A launcher for ``region`` when it is one the engine fuses, else None (lowered kernel by kernel)."""
    layout = AttentionInput.match(region.ops)
    if layout is None or layout.head_dim % 2 or layout.q_width % layout.head_dim or layout.kv_width % layout.head_dim:
        return None  # pie_qkv_rope rotates whole heads of even size
    at = layout.arguments(region)
    if at is None:
        return None

    project = Projection(rt, "auto", eps=layout.eps).run
    q_width, kv_width = layout.q_width, layout.kv_width
    args = QkvRopeArgs()
    args.q_width, args.kv_width, args.head_dim = q_width, kv_width, layout.head_dim
    split_rotate = rt.bind("core", "pie_qkv_rope", args)
    items = q_width // 2 + kv_width // 2 + kv_width
    empty, config = rt.empty, configs.qkv_rope

    def attention_input(*values: Any) -> tuple[DeviceTensor, ...]:
        x = values[at.x]
        bias = None if at.bias is None else values[at.bias]
        qkv = project(x, values[at.weight], bias, None, values[at.norm])
        tokens = x.shape[0]
        q, k, v = empty((tokens, q_width)), empty((tokens, kv_width)), empty((tokens, kv_width))
        if tokens:
            args.qkv, args.positions, args.inv_freq = qkv.ptr, values[at.positions].ptr, values[at.inv_freq].ptr
            args.q, args.k, args.v, args.tokens = q.ptr, k.ptr, v.ptr, tokens
            split_rotate(*config(tokens, items))
        return at.outputs(q, k, v)

    return attention_input
