"""Slang: the C-style kernel generator with HLSL-style declarations, for SPIR-V through the Slang compiler.

Like WGSL, buffers, the params constant buffer and the workgroup arrays are module-scope
declarations named after the entry point (explicit ``[[vk::binding(slot, 0)]]``), so many
kernels can share one module. HLSL has no built-in for the number of workgroups: each
kernel recomputes the grid's x extent from ``rows`` and ``cols`` as ``BindingLayout.groups``
does. Integers wrap through ``uint`` as in C; ``round`` is ``rint`` (SPIR-V's RoundEven, halves to
even as numpy), and Slang has no ``erf``, so the formula of ``pie.eta.evaluate`` is used. As with
WGSL, results that pass through a non-finite value may differ from the other targets: Slang folds
``x * 0.0`` to 0 whatever its floating-point mode, and ``tanh``'s clamp may turn NaN into a bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import DType
from .c_style import KIND_TYPES, CStyleRenderer, arg_lines, reduction_kinds
from .layout import MAX_GROUPS_X, WORKGROUP_SIZE, BindingLayout

if TYPE_CHECKING:
    from ..epilogue import Epilogue

_MATH = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "floor", "ceil", "abs")


class SlangRenderer(CStyleRenderer):
    target = "slang"
    types = {DType.F32: "float", DType.F16: "float", DType.BF16: "float", DType.I32: "int", DType.BOOL: "bool"}
    field_types = {"u32": "uint", "f32": "float", "i32": "int"}
    uint = "uint"
    fn_qualifier = "static"
    as_uint = "asuint"
    as_float = "asfloat"
    infinity = "asfloat(0x7f800000u)"
    helper_math = {"rint": "rint", "fabs": "abs", "exp": "exp"}
    barrier = "GroupMemoryBarrierWithGroupSync();"
    local_id = "lid.x"
    group_x = "wid.x"
    group_y = "wid.y"
    groups_x = "groups_x"
    unsigned_to_int = "int({0})"
    ops = {key: template.replace("unsigned int", "uint") for key, template in CStyleRenderer.ops.items()}
    math = {name: f"{name}({{0}})" for name in _MATH} | {
        "tanh": "tanh(clamp({0}, -15.0f, 15.0f))",  # as WGSL: large |x| gives NaN on some devices
        "round": "rint({0})",
        "erf": "eta_erf({0})",
    }

    def signature(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        lines = []
        for b in layout.buffers:
            kind = "StructuredBuffer" if b.role == "input" else "RWStructuredBuffer"
            name = self.buffer_name(ep, b.role, b.name)
            lines.append(f"[[vk::binding({b.slot}, 0)]] {kind}<{self.types[b.dtype]}> {name};")
        lines.append(
            f"[[vk::binding({layout.params_slot}, 0)]] ConstantBuffer<{ep.entry_point}_params> {ep.entry_point}_p;"
        )
        lines += [
            f"groupshared {self.types[KIND_TYPES[kind]]} {self.shared_name(ep, kind)}[{WORKGROUP_SIZE}];"
            for kind in reduction_kinds(ep)
        ]
        return [
            *lines,
            "",
            '[shader("compute")]',
            f"[numthreads({layout.workgroup_size}, 1, 1)]",
            f"void {ep.entry_point}(",
            *arg_lines(["uint3 lid : SV_GroupThreadID", "uint3 wid : SV_GroupID"]),
            ") {",
        ]

    def body(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        rows, cols = self.param(ep, "rows"), self.param(ep, "cols")
        work = rows if layout.per_row else f"({rows} * {cols} + {WORKGROUP_SIZE - 1}u) / {WORKGROUP_SIZE}u"
        groups = self.let.format(type=self.uint, name="groups_x", value=f"min(max({work}, 1u), {MAX_GROUPS_X}u)")
        return [groups, *super().body(ep, layout)]

    def buffer_name(self, ep: Epilogue, role: str, name: str) -> str:
        return f"{ep.entry_point}_{super().buffer_name(ep, role, name)}"

    def param(self, ep: Epilogue, field: str) -> str:
        return f"{ep.entry_point}_p.{field}"

    def shared_arrays(self, ep: Epilogue) -> list[str]:
        return []  # declared at module scope by `signature`

    def shared_name(self, ep: Epilogue, kind: str) -> str:
        return f"{ep.entry_point}_shm_{kind}"
