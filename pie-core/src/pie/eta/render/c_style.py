"""The C-style renderer family: one kernel generator driven by per-language tables.

`CStyleRenderer` writes CUDA C; HIP, OpenCL C and Metal override tables (qualifiers,
thread ids, math names) and the kernel signature; WGSL also overrides its declarations.

A kernel evaluates the IR as straight-line SSA: every operation gets its own temporary
(`t0`, `t1`, ...) so templates only ever combine names and literals and no precedence
rules leak between languages. User identifiers reach the source only as the mangled
buffer names `in_<name>` / `out_<name>` and struct fields `p_<name>`; numbers are
printed from their parsed values.

Elementwise epilogues run one thread per element (a grid-stride loop). Epilogues with
row reductions run one workgroup per row: each reduction is a pass over the row's
columns, a shared-memory tree reduction and a barrier; a final pass writes the outputs.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from ..evaluate import ERF_AS, ERF_AS_P, ERF_TAYLOR
from ..ir import Const, Index, Load, Node, Op, ParamRef, Reduce, postorder
from ..types import DType, Shape
from .layout import WORKGROUP_SIZE, BindingLayout, layout_of

if TYPE_CHECKING:
    from ..epilogue import Epilogue

FLOAT, INT, BOOL = "f", "i", "b"  # operand kinds: float carrier, i32, bool
I32_MIN = -(2**31)

# C helpers. Placeholders: {fn} function qualifier, {uint}, {as_uint}/{as_float} bit casts
# and the names in `helper_math`. Listed so that a helper only uses helpers before it.
C_HELPERS = {
    # NaN test on the bits: fast-math compilers may fold `x != x` away.
    "eta_isnan": """{fn} bool eta_isnan(float x) {{
    return ({as_uint}(x) & 0x7fffffffu) > 0x7f800000u;
}}""",
    # Round to nearest even at f16 precision, with f16's range (overflow to inf) and
    # subnormals (multiples of 2^-24). Branch-free: selects vectorize and PoCL's barrier
    # handling has trouble with early returns inlined into reduction kernels.
    "eta_f16": """{fn} float eta_f16(float x) {{
    {uint} u = {as_uint}(x);
    {uint} m = u & 0x7fffffffu;
    {uint} sign = u & 0x80000000u;
    {uint} normal = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
    float tiny = {rint}({as_float}(m) * 16777216.0f) * 5.9604644775390625e-08f;
    {uint} bits = m < 0x38800000u ? (sign | {as_uint}(tiny)) : normal;
    bits = m >= 0x477ff000u ? (sign | 0x7f800000u) : bits;
    return m > 0x7f800000u ? x : {as_float}(bits);
}}""",
    "eta_bf16": """{fn} float eta_bf16(float x) {{
    {uint} u = {as_uint}(x);
    {uint} bits = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return eta_isnan(x) ? x : {as_float}(bits);
}}""",
    # Truncate toward zero, saturate, NaN to 0: defined for every input (C's cast is not).
    "eta_f2i": """{fn} int eta_f2i(float x) {{
    bool big = x >= 2147483648.0f;
    float safe = (eta_isnan(x) || big) ? 0.0f : (x < -2147483648.0f ? -2147483648.0f : x);
    return big ? 2147483647 : (int)safe;
}}""",
    # For languages without erf: the formula of pie.eta.evaluate (placeholders `erf_*`).
    "eta_erf": """{fn} float eta_erf(float x) {{
    float a = {fabs}(x);
    float z = x * x;
    float small = x * ({erf_small});
    float t = 1.0f / (1.0f + {erf_p} * a);
    float y = 1.0f - t * ({erf_large}) * {exp}(-a * a);
    return a < 0.5f ? small : (x < 0.0f ? -y : y);
}}""",
}


class CStyleRenderer:
    """CUDA C; the defaults every C-style language starts from."""

    target: ClassVar[str] = "cuda"
    header: ClassVar[str] = ""
    types: ClassVar[dict[DType, str]] = {
        DType.F32: "float",
        DType.F16: "float",
        DType.BF16: "float",
        DType.I32: "int",
        DType.BOOL: "bool",
    }
    field_types: ClassVar[dict[str, str]] = {"u32": "unsigned int", "f32": "float", "i32": "int"}
    uint: ClassVar[str] = "unsigned int"
    fn_qualifier: ClassVar[str] = "__device__ inline"
    as_uint: ClassVar[str] = "__float_as_uint"
    as_float: ClassVar[str] = "__uint_as_float"
    infinity: ClassVar[str] = "__int_as_float(0x7f800000)"
    helpers: ClassVar[dict[str, str]] = C_HELPERS
    helper_math: ClassVar[dict[str, str]] = {"rint": "rintf", "fabs": "fabsf", "exp": "expf"}

    # Statements.
    let: ClassVar[str] = "{type} {name} = {value};"
    var: ClassVar[str] = "{type} {name} = {value};"
    loop: ClassVar[str] = "for ({uint} {name} = {start}; {name} < {end}; {name} += {step}) {{"
    halve: ClassVar[str] = "for ({uint} s = {start}u; s > 0u; s >>= 1u) {{"
    barrier: ClassVar[str] = "__syncthreads();"
    shared: ClassVar[str] = "__shared__ {type} {name}[{size}];"

    # Thread ids, as unsigned expressions; the grid of workgroups is 2-D (see layout.py).
    local_id: ClassVar[str] = "threadIdx.x"
    group_x: ClassVar[str] = "blockIdx.x"
    group_y: ClassVar[str] = "blockIdx.y"
    groups_x: ClassVar[str] = "gridDim.x"

    # WGSL evaluates expressions of literals at shader creation and rejects the module if
    # one overflows or leaves its domain (log2(0.0)): such languages bind literals to
    # temporaries first, which makes every operation a runtime one.
    literal_temporaries: ClassVar[bool] = False
    float_literal: ClassVar[str] = "{}f"
    int_literal: ClassVar[str] = "{}"
    unsigned_to_int: ClassVar[str] = "((int){0})"

    # Operation templates by (op, operand kind); operands are always names or literals.
    ops: ClassVar[dict[tuple[str, str], str]] = {
        ("add", FLOAT): "({0} + {1})",
        ("sub", FLOAT): "({0} - {1})",
        ("mul", FLOAT): "({0} * {1})",
        ("div", FLOAT): "({0} / {1})",
        ("neg", FLOAT): "(-{0})",
        # NaN-propagating like numpy's minimum/maximum.
        ("min", FLOAT): "((eta_isnan({0}) || {0} < {1}) ? {0} : {1})",
        ("max", FLOAT): "((eta_isnan({0}) || {0} > {1}) ? {0} : {1})",
        # Signed overflow is undefined in C: wrap through unsigned, as numpy's int32 does.
        ("add", INT): "((int)((unsigned int){0} + (unsigned int){1}))",
        ("sub", INT): "((int)((unsigned int){0} - (unsigned int){1}))",
        ("mul", INT): "((int)((unsigned int){0} * (unsigned int){1}))",
        ("neg", INT): "((int)(0u - (unsigned int){0}))",
        ("abs", INT): "(({0} < 0) ? (int)(0u - (unsigned int){0}) : {0})",
        ("min", INT): "(({0} < {1}) ? {0} : {1})",
        ("max", INT): "(({0} > {1}) ? {0} : {1})",
        **{
            (op, kind): f"({{0}} {sym} {{1}})"
            for op, sym in (("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("eq", "=="))
            for kind in (FLOAT, INT, BOOL)
        },
        # `!(a == b)`: some compilers treat NaN != NaN as false (an ordered compare).
        **{("ne", kind): "(!({0} == {1}))" for kind in (FLOAT, INT, BOOL)},
        ("and", BOOL): "({0} && {1})",
        ("or", BOOL): "({0} || {1})",
        ("not", BOOL): "(!{0})",
        **{("select", kind): "({0} ? {1} : {2})" for kind in (FLOAT, INT, BOOL)},
    }
    math: ClassVar[dict[str, str]] = {
        name: f"{name}f({{0}})"
        for name in ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sin", "cos", "erf", "floor", "ceil")
    } | {"round": "rintf({0})", "abs": "fabsf({0})"}
    casts: ClassVar[dict[tuple[str, DType], str]] = {
        (FLOAT, DType.F16): "eta_f16({0})",
        (FLOAT, DType.BF16): "eta_bf16({0})",
        (FLOAT, DType.I32): "eta_f2i({0})",
        (FLOAT, DType.BOOL): "(!({0} == 0.0f))",
        (INT, DType.F32): "((float){0})",
        (INT, DType.BOOL): "({0} != 0)",
        (BOOL, DType.F32): "({0} ? 1.0f : 0.0f)",
        (BOOL, DType.I32): "({0} ? 1 : 0)",
    }

    # -- module --------------------------------------------------------------------

    def module(self, epilogues: Sequence[Epilogue]) -> str:
        """One source file holding a kernel per epilogue and the helpers they use."""
        kernels = "\n\n".join("\n".join(self.kernel(ep)) for ep in epilogues)
        used: list[str] = []
        for name in reversed(self.helpers):  # a helper only calls helpers listed before it
            if any(name + "(" in text for text in [kernels, *(self.helper(u) for u in used)]):
                used.insert(0, name)
        parts = [self.header, *(self.helper(name) for name in used), kernels]
        return "\n\n".join(part for part in parts if part) + "\n"

    def helper(self, name: str) -> str:
        erf = {
            "erf_small": _horner("z", ERF_TAYLOR, self.float_literal),
            "erf_large": _horner("t", ERF_AS, self.float_literal),
            "erf_p": self.float_literal.format(_shortest_f32(_f32(ERF_AS_P))),
        }
        qualifiers = {"fn": self.fn_qualifier, "uint": self.uint, "as_uint": self.as_uint, "as_float": self.as_float}
        return self.helpers[name].format(**qualifiers, **self.helper_math, **erf)

    def kernel(self, ep: Epilogue) -> list[str]:
        layout = layout_of(ep)
        return [*self.params_struct(ep, layout), *self.signature(ep, layout), *indent(self.body(ep, layout)), "}"]

    # -- per-language pieces -------------------------------------------------------

    def params_struct(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        fields = [
            f"    {self.field_types[f.storage]} {self.field_name(f.name, i)};" for i, f in enumerate(layout.fields)
        ]
        return [f"struct {ep.entry_point}_params {{", *fields, "};", ""]

    def signature(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        args = [f"{self.buffer_type(b.role, b.dtype)} {self.buffer_name(ep, b.role, b.name)}" for b in layout.buffers]
        args.append(f"{ep.entry_point}_params p")
        return [
            f'extern "C" __global__ void __launch_bounds__({layout.workgroup_size}) {ep.entry_point}(',
            *arg_lines(args),
            ") {",
        ]

    def buffer_type(self, role: str, dtype: DType) -> str:
        return f"{'const ' if role == 'input' else ''}{self.types[dtype]}*"

    def buffer_name(self, ep: Epilogue, role: str, name: str) -> str:
        return f"{'in' if role == 'input' else 'out'}_{name}"

    def field_name(self, name: str, index: int) -> str:
        return name if index < 2 else f"p_{name}"

    def param(self, ep: Epilogue, field: str) -> str:
        return f"p.{field}"

    def shared_arrays(self, ep: Epilogue) -> list[str]:
        """Declarations of the workgroup arrays the row reductions use."""
        return [
            self.shared.format(type=self.types[KIND_TYPES[k]], name=self.shared_name(ep, k), size=WORKGROUP_SIZE)
            for k in reduction_kinds(ep)
        ]

    def shared_name(self, ep: Epilogue, kind: str) -> str:
        return f"shm_{kind}"

    # -- values --------------------------------------------------------------------

    def literal(self, node: Const) -> str:
        if node.dtype is DType.BOOL:
            return "true" if node.value else "false"
        if node.dtype is DType.I32:
            if node.value == I32_MIN:
                return self.i32_min()
            text = self.int_literal.format(abs(node.value))
            return f"(-{text})" if node.value < 0 else text
        if node.raw & 0x7FFFFFFF == 0x7F800000:
            return f"(-{self.infinity})" if node.raw >> 31 else self.infinity
        text = self.float_literal.format(_shortest_f32(abs(node.value)))
        return f"(-{text})" if node.raw >> 31 else text

    def operation(self, node: Op, args: list[str], kinds: list[str]) -> str:
        if node.op == "cast":
            return self.casts[kinds[0], node.dtype].format(*args)
        if (node.op, kinds[-1]) in self.ops:
            return self.ops[node.op, kinds[-1]].format(*args)
        return self.math[node.op].format(*args)

    # -- kernel body ---------------------------------------------------------------

    def body(self, ep: Epilogue, layout: BindingLayout) -> list[str]:
        roots = [o.value for o in ep.outputs]
        reductions = [n for n in postorder(roots) if isinstance(n, Reduce)]
        values = _Values(self, ep)
        group = f"({self.group_y} * {self.groups_x} + {self.group_x})"
        rows, cols = self.param(ep, "rows"), self.param(ep, "cols")
        if not reductions:  # one thread per element
            stores = self.stores(ep, values, roots)
            positions = []
            if values.uses & {"r", "c"}:
                positions.append(self.let.format(type=self.uint, name="r", value=f"i / {cols}"))
            if "c" in values.uses:
                positions.append(self.let.format(type=self.uint, name="c", value=f"i - r * {cols}"))
            element = f"{group} * {WORKGROUP_SIZE}u + {self.local_id}"
            return [
                self.let.format(type=self.uint, name="i", value=element),
                f"if (i < {rows} * {cols}) {{",
                *indent(positions + stores),
                "}",
            ]
        # One workgroup per row: each reduction is a pass over the row, then the outputs.
        # Workgroups past the last row see no columns; every barrier stays unconditional
        # (PoCL miscompiles some barriers inside a branch, even a uniform one).
        lines = [
            *self.shared_arrays(ep),
            self.let.format(type=self.uint, name="r", value=group),
            self.let.format(type=self.uint, name="n", value=self.ops["select", INT].format(f"r < {rows}", cols, "0u")),
        ]
        for k, reduction in enumerate(reductions):
            lines += self.reduction(ep, reduction, k, values)
        stores = self.stores(ep, values, roots)
        return lines + self.column_loop(ep, stores, values)

    def column_loop(self, ep: Epilogue, inner: list[str], values: _Values) -> list[str]:
        """A loop of the workgroup's threads over row r's n columns; `inner` sees c (and i)."""
        index = (
            [self.let.format(type=self.uint, name="i", value=f"r * {self.param(ep, 'cols')} + c")]
            if "i" in values.uses
            else []
        )
        head = self.loop.format(uint=self.uint, name="c", start=self.local_id, end="n", step=f"{WORKGROUP_SIZE}u")
        return [head, *indent(index + inner), "}"]

    def reduction(self, ep: Epilogue, node: Reduce, k: int, values: _Values) -> list[str]:
        kind = _kind(node.dtype)
        ctype, shm = self.types[node.dtype], self.shared_name(ep, kind)
        combine = self.ops[node.op if node.op != "sum" else "add", kind]
        acc = f"acc{k}"
        lines, exprs = values.compute([node.operand])
        inner = [*lines, f"{acc} = {combine.format(acc, exprs[id(node.operand)])};"]
        tree = [
            f"if ({self.local_id} < s) {{",
            *indent(
                [
                    self.let.format(type=ctype, name="lhs", value=f"{shm}[{self.local_id}]"),
                    self.let.format(type=ctype, name="rhs", value=f"{shm}[{self.local_id} + s]"),
                    f"{shm}[{self.local_id}] = {combine.format('lhs', 'rhs')};",
                ]
            ),
            "}",
            self.barrier,
        ]
        name = values.reduced(node)
        return [
            self.var.format(type=ctype, name=acc, value=self.identity(node)),
            *self.column_loop(ep, inner, values),
            f"{shm}[{self.local_id}] = {acc};",
            self.barrier,
            self.halve.format(uint=self.uint, start=WORKGROUP_SIZE // 2),
            *indent(tree),
            "}",
            self.let.format(type=ctype, name=name, value=f"{shm}[0]"),
            self.barrier,  # everyone has read shm[0] before the next reduction reuses it
        ]

    def identity(self, node: Reduce) -> str:
        if node.op == "sum":
            return self.float_literal.format("0.0") if node.dtype.is_float else self.int_literal.format(0)
        if node.dtype.is_float:
            return self.infinity if node.op == "min" else f"(-{self.infinity})"
        return self.int_literal.format(2147483647) if node.op == "min" else self.i32_min()

    def i32_min(self) -> str:
        """i32's least value: written `2147483648` would be out of i32's range (an error in WGSL)."""
        return f"(-{self.int_literal.format(2147483647)} - {self.int_literal.format(1)})"

    def stores(self, ep: Epilogue, values: _Values, roots: list[Node]) -> list[str]:
        lines, exprs = values.compute(roots)
        values.uses.add("i")
        for output in ep.outputs:
            lines.append(f"{self.buffer_name(ep, 'output', output.name)}[i] = {exprs[id(output.value)]};")
        return lines

    def load(self, ep: Epilogue, node: Load, index: str) -> str:
        return f"{self.buffer_name(ep, 'input', node.name)}[{index}]"

    def index(self, ep: Epilogue, which: str) -> str:
        return self.unsigned_to_int.format(_POSITION.get(which) or self.param(ep, which))


class _Values:
    """SSA state of one kernel: temporaries are numbered across all its passes, and
    `uses` collects the index variables (r, c, i) the last `compute` referred to."""

    def __init__(self, renderer: CStyleRenderer, ep: Epilogue) -> None:
        self.renderer = renderer
        self.ep = ep
        self.count = 0
        self.reductions: dict[int, str] = {}
        self.uses: set[str] = set()

    def reduced(self, node: Reduce) -> str:
        name = f"rd{len(self.reductions)}"
        self.reductions[id(node)] = name
        return name

    def compute(self, roots: list[Node]) -> tuple[list[str], dict[int, str]]:
        """Statements computing `roots` for element (r, c, i); returns them and each node's expression."""
        r, ep = self.renderer, self.ep
        exprs: dict[int, str] = dict(self.reductions)
        lines: list[str] = []
        self.uses = set()
        for node in postorder(roots, leaves=(Reduce,)):
            if id(node) in exprs:
                continue
            args = [exprs[id(a)] for a in node.args]
            match node:
                case Const() if not r.literal_temporaries:
                    exprs[id(node)] = r.literal(node)
                    continue
                case Const():
                    value = r.literal(node)
                case ParamRef():
                    field = r.param(ep, f"p_{node.name}")
                    exprs[id(node)] = f"({field} != 0u)" if node.dtype is DType.BOOL else field
                    continue
                case Index():
                    self.uses.add(_POSITION.get(node.which, ""))
                    exprs[id(node)] = r.index(ep, node.which)
                    continue
                case Op(op="cast") if node.dtype is DType.F32 and node.operands[0].dtype.is_float:
                    exprs[id(node)] = args[0]  # f16/bf16 -> f32 is free: same carrier
                    continue
                case Load():
                    index = _LOAD_INDEX[node.shape]
                    self.uses.add(index)
                    value = r.load(ep, node, index)
                case Op():
                    value = r.operation(node, args, [_kind(a.dtype) for a in node.args])
            name = f"t{self.count}"
            self.count += 1
            lines.append(r.let.format(type=r.types[node.dtype], name=name, value=value))
            exprs[id(node)] = name
        return lines, exprs


KIND_TYPES = {FLOAT: DType.F32, INT: DType.I32, BOOL: DType.BOOL}
_LOAD_INDEX = {Shape.FULL: "i", Shape.COLS: "c", Shape.ROWS: "r"}  # the loop variable each shape reads at
_POSITION = {"row": "r", "col": "c"}


def reduction_kinds(ep: Epilogue) -> list[str]:
    """Operand kinds of the epilogue's row reductions: one workgroup array each."""
    return sorted({_kind(n.dtype) for n in postorder(o.value for o in ep.outputs) if isinstance(n, Reduce)})


def _kind(dtype: DType) -> str:
    return FLOAT if dtype.is_float else INT if dtype is DType.I32 else BOOL


def indent(lines: list[str]) -> list[str]:
    return ["    " + line if line else line for line in lines]


def arg_lines(args: list[str]) -> list[str]:
    return [f"    {arg}," for arg in args[:-1]] + [f"    {args[-1]}"]


def _horner(x: str, coefficients: tuple[float, ...], literal: str) -> str:
    """`c0 + x * (c1 + x * (...))` with each coefficient rounded to f32."""
    terms = [literal.format(_shortest_f32(_f32(abs(c)))) for c in coefficients]
    signs = ["-" if c < 0 else "" for c in coefficients]
    text = f"{signs[-1]}{terms[-1]}"
    for sign, term in zip(reversed(signs[:-1]), reversed(terms[:-1]), strict=True):
        text = f"{sign}{term} + {x} * ({text})"
    return text


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _shortest_f32(value: float) -> str:
    """The shortest decimal that reads back as the same f32 (from the value, not user text)."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        try:
            same = _f32(float(text)) == value
        except OverflowError:  # a rounding of a value near f32's largest can lie past it
            continue
        if same:
            return text if "." in text or "e" in text else text + ".0"
    raise AssertionError(value)
