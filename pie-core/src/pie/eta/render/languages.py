"""HIP, OpenCL C and Metal: the C-style renderer with their own tables and signatures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .c_style import CStyleRenderer, arg_lines
from .layout import BindingLayout

if TYPE_CHECKING:
    from ..epilogue import Epilogue

_MATH = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sin", "cos", "erf", "floor", "ceil")


class HipRenderer(CStyleRenderer):
    """HIP is CUDA C for hiprtc: the same builtins, qualifiers and launch bounds."""

    target = "hip"


class OpenCLRenderer(CStyleRenderer):
    target = "opencl"
    uint = "uint"
    fn_qualifier = "static inline"
    as_uint = "as_uint"
    as_float = "as_float"
    infinity = "INFINITY"
    barrier = "barrier(CLK_LOCAL_MEM_FENCE);"
    shared = "__local {type} {name}[{size}];"
    local_id = "(uint)get_local_id(0)"
    group_x = "(uint)get_group_id(0)"
    group_y = "(uint)get_group_id(1)"
    groups_x = "(uint)get_num_groups(0)"
    math = {name: f"{name}({{0}})" for name in _MATH} | {"round": "rint({0})", "abs": "fabs({0})"}
    helper_math = {"rint": "rint", "fabs": "fabs", "exp": "exp"}

    def params_struct(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        lines = super().params_struct(ep, layout)
        return ["typedef struct {", *lines[1:-2], f"}} {ep.entry_point}_params;", ""]

    def signature(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        args = [
            f"__global {self.buffer_type(b.role, b.dtype)} {self.buffer_name(ep, b.role, b.name)}"
            for b in layout.buffers
        ]
        args.append(f"const {ep.entry_point}_params p")
        size = layout.workgroup_size
        return [
            f"__kernel __attribute__((reqd_work_group_size({size}, 1, 1))) void {ep.entry_point}(",
            *arg_lines(args),
            ") {",
        ]


class MetalRenderer(CStyleRenderer):
    """Metal Shading Language. `precise::` math keeps results IEEE-accurate even when the
    library is compiled with fast math (Metal's default); MSL has no erf, so it uses ours."""

    target = "metal"
    header = "#include <metal_stdlib>\nusing namespace metal;"
    uint = "uint"
    fn_qualifier = "inline"
    as_uint = "as_type<uint>"
    as_float = "as_type<float>"
    infinity = "INFINITY"
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    shared = "threadgroup {type} {name}[{size}];"
    local_id = "lid"
    group_x = "wid.x"
    group_y = "wid.y"
    groups_x = "nwg.x"
    math = {name: f"precise::{name}({{0}})" for name in _MATH if name not in ("erf", "floor", "ceil")} | {
        "erf": "eta_erf({0})",
        "floor": "floor({0})",
        "ceil": "ceil({0})",
        "round": "rint({0})",
        "abs": "fabs({0})",
    }
    helper_math = {"rint": "rint", "fabs": "fabs", "exp": "precise::exp"}

    def signature(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        args = [
            f"device {self.buffer_type(b.role, b.dtype)} {self.buffer_name(ep, b.role, b.name)} [[buffer({b.slot})]]"
            for b in layout.buffers
        ]
        args += [
            f"constant {ep.entry_point}_params& p [[buffer({layout.params_slot})]]",
            "uint lid [[thread_position_in_threadgroup]]",
            "uint2 wid [[threadgroup_position_in_grid]]",
            "uint2 nwg [[threadgroups_per_grid]]",
        ]
        return [f"kernel void {ep.entry_point}(", *arg_lines(args), ") {"]
