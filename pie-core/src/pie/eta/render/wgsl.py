"""WGSL: the C-style kernel generator with WGSL declarations, bindings and helpers.

Buffers, the params uniform and workgroup arrays are module-scope variables named after
the entry point, so many kernels can share one module. WGSL promises nothing about NaN and
infinity (lavapipe, for one, folds `x * 0.0` to 0), so results that pass through a
non-finite value may differ from the other targets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import DType
from .c_style import BOOL, FLOAT, INT, KIND_TYPES, CStyleRenderer, arg_lines, reduction_kinds
from .layout import WORKGROUP_SIZE, BindingLayout

if TYPE_CHECKING:
    from ..epilogue import Epilogue

_HELPERS = {
    # Infinity at run time: a literal infinity would be a shader-creation error.
    "eta_inf": """fn eta_inf() -> f32 {{
    let bits: u32 = 0x7f800000u;
    return bitcast<f32>(bits);
}}""",
    "eta_isnan": """fn eta_isnan(x: f32) -> bool {{
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}}""",
    "eta_f16": """fn eta_f16(x: f32) -> f32 {{
    var u: u32 = bitcast<u32>(x);
    let m: u32 = u & 0x7fffffffu;
    if (m > 0x7f800000u) {{ return x; }}
    if (m >= 0x477ff000u) {{ return bitcast<f32>((u & 0x80000000u) | 0x7f800000u); }}
    if (m < 0x38800000u) {{
        let q: f32 = round(bitcast<f32>(m) * 16777216.0f) * 5.9604644775390625e-08f;
        return bitcast<f32>((u & 0x80000000u) | bitcast<u32>(q));
    }}
    u += 0xfffu + ((u >> 13u) & 1u);
    return bitcast<f32>(u & 0xffffe000u);
}}""",
    "eta_bf16": """fn eta_bf16(x: f32) -> f32 {{
    var u: u32 = bitcast<u32>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {{ return x; }}
    u += 0x7fffu + ((u >> 16u) & 1u);
    return bitcast<f32>(u & 0xffff0000u);
}}""",
    "eta_f2i": """fn eta_f2i(x: f32) -> i32 {{
    if (eta_isnan(x)) {{ return 0i; }}
    if (x >= 2147483648.0f) {{ return 2147483647i; }}
    if (x < -2147483648.0f) {{ return -2147483647i - 1i; }}
    return i32(x);
}}""",
    "eta_erf": """fn eta_erf(x: f32) -> f32 {{
    let a: f32 = abs(x);
    let z: f32 = x * x;
    let small: f32 = x * ({erf_small});
    let t: f32 = 1.0f / (1.0f + {erf_p} * a);
    let y: f32 = 1.0f - t * ({erf_large}) * exp(-a * a);
    return select(select(y, -y, x < 0.0f), small, a < 0.5f);
}}""",
}


class WgslRenderer(CStyleRenderer):
    target = "wgsl"
    types = {DType.F32: "f32", DType.F16: "f32", DType.BF16: "f32", DType.I32: "i32", DType.BOOL: "bool"}
    field_types = {"u32": "u32", "f32": "f32", "i32": "i32"}
    uint = "u32"
    helpers = _HELPERS
    let = "let {name}: {type} = {value};"
    var = "var {name}: {type} = {value};"
    loop = "for (var {name}: {uint} = {start}; {name} < {end}; {name} += {step}) {{"
    halve = "for (var s: {uint} = {start}u; s > 0u; s >>= 1u) {{"
    barrier = "workgroupBarrier();"
    local_id = "lid.x"
    group_x = "wid.x"
    group_y = "wid.y"
    groups_x = "nwg.x"
    infinity = "eta_inf()"
    literal_temporaries = True
    int_literal = "{}i"
    unsigned_to_int = "i32({0})"
    ops = CStyleRenderer.ops | {
        # WGSL integers wrap on overflow and abs(i32 min) is i32 min: no unsigned detour.
        ("add", INT): "({0} + {1})",
        ("sub", INT): "({0} - {1})",
        ("mul", INT): "({0} * {1})",
        ("neg", INT): "(-{0})",
        ("abs", INT): "abs({0})",
        ("min", INT): "min({0}, {1})",
        ("max", INT): "max({0}, {1})",
        ("min", FLOAT): "select({1}, {0}, eta_isnan({0}) || {0} < {1})",
        ("max", FLOAT): "select({1}, {0}, eta_isnan({0}) || {0} > {1})",
        **{("select", kind): "select({2}, {1}, {0})" for kind in (FLOAT, INT, BOOL)},
    }
    math = {
        name: f"{name}({{0}})"
        for name in ("exp", "exp2", "log", "log2", "sqrt", "sin", "cos", "floor", "ceil", "round", "abs")
    } | {
        "rsqrt": "inverseSqrt({0})",
        "tanh": "tanh(clamp({0}, -15.0f, 15.0f))",  # some backends return NaN for large |x|
        "erf": "eta_erf({0})",
    }
    casts = CStyleRenderer.casts | {
        (INT, DType.F32): "f32({0})",
        (INT, DType.BOOL): "({0} != 0i)",
        (BOOL, DType.F32): "select(0.0f, 1.0f, {0})",
        (BOOL, DType.I32): "select(0i, 1i, {0})",
    }

    def params_struct(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        fields = [
            f"    {self.field_name(f.name, i)}: {self.field_types[f.storage]}," for i, f in enumerate(layout.fields)
        ]
        return [f"struct {ep.entry_point}_params {{", *fields, "}", ""]

    def signature(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        lines = []
        for b in layout.buffers:
            access = "read" if b.role == "input" else "read_write"
            name = self.buffer_name(ep, b.role, b.name)
            lines.append(f"@group(0) @binding({b.slot}) var<storage, {access}> {name}: array<{self.types[b.dtype]}>;")
        lines.append(
            f"@group(0) @binding({layout.params_slot}) var<uniform> {ep.entry_point}_p: {ep.entry_point}_params;"
        )
        lines += [
            f"var<workgroup> {self.shared_name(ep, kind)}: array<{self.types[KIND_TYPES[kind]]}, {WORKGROUP_SIZE}>;"
            for kind in reduction_kinds(ep)
        ]
        builtins = [
            "@builtin(local_invocation_id) lid: vec3<u32>",
            "@builtin(workgroup_id) wid: vec3<u32>",
            "@builtin(num_workgroups) nwg: vec3<u32>",
        ]
        return [
            *lines,
            "",
            f"@compute @workgroup_size({layout.workgroup_size})",
            f"fn {ep.entry_point}(",
            *arg_lines(builtins),
            ") {",
        ]

    def buffer_name(self, ep: Epilogue, role: str, name: str) -> str:
        return f"{ep.entry_point}_{super().buffer_name(ep, role, name)}"

    def param(self, ep: Epilogue, field: str) -> str:
        return f"{ep.entry_point}_p.{field}"

    def shared_arrays(self, ep: Epilogue) -> list[str]:
        return []  # declared at module scope by `signature`

    def shared_name(self, ep: Epilogue, kind: str) -> str:
        return f"{ep.entry_point}_shm_{kind}"
