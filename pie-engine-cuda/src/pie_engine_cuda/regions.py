"""Whole regions the CUDA engine runs in fewer launches than their kernels.

A launch costs the host several microseconds of Python and driver, and at batch 1 a decode step is
bound by them, not by the GPU. The attention input region (RMSNorm, the QKV projection, three column
slices, two RoPEs: six launches once the norm is fused into the projection) becomes two: the
projection, and one kernel that splits its rows into q, k and v and rotates q and k. The region is read
from its description (`pie.contract.AttentionInputRegion`), not its ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pie.contract import KernelRequest, Launcher, RegionRequest
from pie.enginekit.regions import attention_input_signature
from pie.poem.lower import bucketed_launcher
from pie.profiles.loader import parse_profile
from pie.profiles.schema import ProfileChooser
from pie.profiles.shipped import shipped_profiles

from pie_engine_cuda import launch as configs
from pie_engine_cuda.args import STRUCTS
from pie_engine_cuda.launchers import kernel_listing, make_projection
from pie_engine_cuda.runtime import GpuDevice
from pie_engine_cuda.tensor import DeviceTensor


def default_projection(rt: GpuDevice, eps: float) -> Launcher:
    """The region's RMSNorm and QKV projection (``rms_norm_linear``'s arguments), its variant per row count
    the one the engine's default profile gives ``rms_norm_linear``: core's profiles never see inside a region."""
    listed = kernel_listing(rt.facts.tensor_cores)["rms_norm_linear"]
    launchers = {variant: make_projection(rt, KernelRequest("rms_norm_linear", variant, (("eps", eps),)))
                 for variant in listed}
    [text] = shipped_profiles("pie_engine_cuda")
    buckets = ProfileChooser(None, parse_profile(text, "cuda-default.toml"))("rms_norm_linear")
    if buckets is None:
        return launchers[listed[0]]
    return bucketed_launcher("rms_norm_linear", buckets.restricted(listed), launchers, launchers[listed[0]])


def compile_region(rt: GpuDevice, region: RegionRequest) -> Callable[..., tuple[DeviceTensor, ...]] | None:
    """A launcher for ``region`` when it is one the engine fuses, else None (lowered kernel by kernel)."""
    at = attention_input_signature(region)
    if at is None or at.layer.qk_norm or at.layer.head_dim % 2:
        return None  # per-head Q/K norms are not in pie_qkv_rope, which rotates whole heads of even size
    project = default_projection(rt, at.layer.eps)
    q_width, kv_width = at.q_width, at.kv_width
    args = STRUCTS["QkvRopeArgs"]()
    args.q_width, args.kv_width, args.head_dim = q_width, kv_width, at.layer.head_dim
    split_rotate = rt.bind("core", "pie_qkv_rope", args)
    items = q_width // 2 + kv_width // 2 + kv_width
    empty, config = rt.empty, configs.qkv_rope

    def attention_input(*values: Any) -> tuple[DeviceTensor, ...]:
        x = values[at.x]
        bias = None if at.bias is None else values[at.bias]
        qkv = project(x, values[at.norm], values[at.weight], bias)
        tokens = x.shape[0]
        q, k, v = empty((tokens, q_width)), empty((tokens, kv_width)), empty((tokens, kv_width))
        if tokens:
            args.qkv, args.positions, args.inv_freq = qkv.ptr, values[at.positions].ptr, values[at.inv_freq].ptr
            args.q, args.k, args.v, args.tokens = q.ptr, k.ptr, v.ptr, tokens
            split_rotate(*config(tokens, items))
        return at.outputs((q, k, v))

    return attention_input
