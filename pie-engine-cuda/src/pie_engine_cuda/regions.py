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
from pie.poem.patterns import ATTENTION_INPUT, AttentionInput

from pie_engine_cuda import launch as configs
from pie_engine_cuda.args import QkvRopeArgs
from pie_engine_cuda.launchers import Projection
from pie_engine_cuda.runtime import Runtime
from pie_engine_cuda.tensor import DeviceTensor


def compile_region(rt: Runtime, region: RegionRequest) -> Callable[..., tuple[DeviceTensor, ...]] | None:
    """A launcher for ``region`` when it is one the engine fuses, else None (lowered kernel by kernel)."""
    if tuple(op.kernel for op in region.ops) != ATTENTION_INPUT:
        return None
    layout = AttentionInput.match(region.ops)
    if layout is None or layout.head_dim % 2 or layout.q_width % layout.head_dim or layout.kv_width % layout.head_dim:
        return None  # pie_qkv_rope rotates whole heads of even size
    outputs = {layout.rope_q.output: 0, layout.rope_k.output: 1, layout.v_slice.output: 2}
    if set(region.outputs) != set(outputs):
        return None
    order = [outputs[name] for name in region.outputs]
    position: dict[str | None, int] = {name: index for index, name in enumerate(region.inputs)}
    norm, projection, rope_q = layout.norm, layout.projection, layout.rope_q
    x_at, norm_at, weight_at = position[norm.inputs[0]], position[norm.inputs[1]], position[projection.inputs[1]]
    bias_at = position.get(projection.inputs[2]) if projection.inputs[2] is not None else None
    positions_at, inv_freq_at = position[rope_q.inputs[1]], position[rope_q.inputs[2]]

    project = Projection(rt, "auto", eps=layout.eps).run
    q_width, kv_width = layout.q_width, layout.kv_width
    args = QkvRopeArgs()
    args.q_width, args.kv_width, args.head_dim = q_width, kv_width, layout.head_dim
    split_rotate = rt.bind("core", "pie_qkv_rope", args)
    items = q_width // 2 + kv_width // 2 + kv_width
    empty, config = rt.empty, configs.qkv_rope

    def attention_input(*values: Any) -> tuple[DeviceTensor, ...]:
        x = values[x_at]
        bias = None if bias_at is None else values[bias_at]
        qkv = project(x, values[weight_at], bias, None, values[norm_at])
        tokens = x.shape[0]
        q, k, v = empty((tokens, q_width)), empty((tokens, kv_width)), empty((tokens, kv_width))
        if tokens:
            args.qkv, args.positions, args.inv_freq = qkv.ptr, values[positions_at].ptr, values[inv_freq_at].ptr
            args.q, args.k, args.v, args.tokens = q.ptr, k.ptr, v.ptr, tokens
            split_rotate(*config(tokens, items))
        found = (q, k, v)
        return tuple(found[i] for i in order)

    return attention_input
