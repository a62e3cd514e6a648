"""Name resolution and type checking: eta syntax trees to the typed IR.

Typing rules, in short:

* No implicit conversions between f32, f16, bf16, i32 and bool: mixing them is an
  `EtaTypeError`; the type names are cast functions (`f16(x)`, `i32(x)`, `bool(x)`).
* Number literals take the type their context needs: `x * 2` is f16 if `x` is f16. A
  float literal never becomes an i32. Literal-only expressions default to f32 or i32. A
  minus before an integer literal in i32 context is part of it: `-2147483648` is an i32.
* `/` and the math functions need floats; `&&`, `||`, `!` and `select`'s condition need
  bools; `<`-style comparisons need numbers.
* Inputs and outputs are stored as f32 or i32; outputs must have their declared type.
* Limits: `MAX_BUFFERS` inputs and outputs, `MAX_PARAMS` params, `MAX_REDUCTIONS` distinct
  row reductions.

Lowering: float arithmetic on f16/bf16 is computed in f32 and rounded back with a
`cast`, composite functions (sigmoid, silu, gelu, clamp, row_mean) are expanded into
primitives, and every IR node is interned in one `Graph`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection

from .errors import EtaTypeError
from .ir import Const, Graph, Index, Input, Load, Node, Op, Output, Param, ParamRef, Reduce
from .names import COMPOSITE_FUNCTIONS, MATH_FUNCTIONS, REDUCTIONS, TYPE_NAMES
from .syntax import Binary, Call, Expr, InputDecl, Let, Name, Num, OutDecl, ParamDecl, Pos, Stmt, Unary
from .types import STORAGE_TYPES, DType, Shape

MAX_BUFFERS = 8  # WebGPU's default limit of storage buffers per shader stage
MAX_PARAMS = 32
# Each distinct row reduction is a pass over the row that recomputes the values it reduces, so the kernel's
# size grows with reductions times program size; real epilogues need one or two (softmax, layer norm).
MAX_REDUCTIONS = 8

_ARITHMETIC = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
_COMPARE = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_ARITY = {
    **dict.fromkeys(MATH_FUNCTIONS + COMPOSITE_FUNCTIONS + REDUCTIONS + ("abs",), 1),
    "min": 2,
    "max": 2,
    "clamp": 3,
    "select": 3,
}
_INF_BITS = 0x7F800000


def check(statements: list[Stmt], source: str) -> tuple[tuple[Input, ...], tuple[Param, ...], tuple[Output, ...]]:
    """Type-check a parsed program; returns its declarations with outputs as IR."""
    return _Checker(source).program(statements)


def literal_kind(expr: Expr) -> str | None:
    """'int' or 'float' if `expr` is built from literals only (so its type is flexible)."""
    kind: str | None = "int"
    while isinstance(expr, Binary) and expr.op in _ARITHMETIC:  # along a flat chain (`1 + 2 + ...`): no recursion
        kind = _combine(kind, literal_kind(expr.right))
        if kind is None:
            return None
        expr = expr.left
    match expr:
        case Num():
            return _combine(kind, "float" if expr.is_float else "int")
        case Name() if expr.name == "inf":
            return "float"
        case Unary(op="-"):
            return _combine(kind, literal_kind(expr.operand))
        case Call() if expr.args and expr.name in MATH_FUNCTIONS + COMPOSITE_FUNCTIONS + ("abs", "min", "max", "clamp"):
            kinds = [literal_kind(arg) for arg in expr.args]
            if None in kinds:
                return None
            return "float" if expr.name in MATH_FUNCTIONS + COMPOSITE_FUNCTIONS or "float" in kinds else "int"
    return None


def _left_chain(expr: Binary, ops: Collection[str]) -> list[Binary]:
    """`expr` and the operators of `ops` down its left operands, innermost first: `a + b - c` gives
    `[a + b, (a + b) - c]`. The parser bounds nesting, not the length of such a flat chain."""
    chain = [expr]
    while isinstance(chain[-1].left, Binary) and chain[-1].left.op in ops:
        chain.append(chain[-1].left)
    chain.reverse()
    return chain


def _combine(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return None
    return "float" if "float" in (a, b) else "int"


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source
        self.graph = Graph()
        self.env: dict[str, Node] = {}
        self.reductions: set[int] = set()  # ids of the distinct Reduce nodes built

    def error(self, message: str, pos: Pos) -> EtaTypeError:
        return EtaTypeError(message, self.source, pos.line, pos.column)

    def make(self, node: Node) -> Node:
        return self.graph.intern(node)

    # -- statements ----------------------------------------------------------------

    def program(self, statements: list[Stmt]) -> tuple[tuple[Input, ...], tuple[Param, ...], tuple[Output, ...]]:
        inputs: list[Input] = []
        params: list[Param] = []
        outputs: list[Output] = []
        for stmt in statements:
            if stmt.name in self.env:
                raise self.error(f"{stmt.name!r} is already defined", stmt.pos)
            match stmt:
                case InputDecl():
                    dtype = self.storage_type(stmt.dtype, stmt.type_pos, "inputs")
                    if len(inputs) + len(outputs) == MAX_BUFFERS:
                        raise self.error(f"an epilogue has at most {MAX_BUFFERS} inputs and outputs", stmt.pos)
                    inputs.append(Input(stmt.name, dtype, Shape(stmt.shape)))
                    self.env[stmt.name] = self.make(Load(dtype, stmt.name, Shape(stmt.shape)))
                case ParamDecl():
                    if len(params) == MAX_PARAMS:
                        raise self.error(f"an epilogue has at most {MAX_PARAMS} params", stmt.pos)
                    dtype = DType(stmt.dtype)
                    params.append(Param(stmt.name, dtype))
                    carrier = DType.F32 if dtype.is_float else dtype
                    self.env[stmt.name] = self.cast(self.make(ParamRef(carrier, stmt.name)), dtype)
                case Let():
                    self.env[stmt.name] = self.expr(stmt.value, None)
                case OutDecl():
                    dtype = self.storage_type(stmt.dtype or "f32", stmt.type_pos or stmt.pos, "outputs")
                    if len(inputs) + len(outputs) == MAX_BUFFERS:
                        raise self.error(f"an epilogue has at most {MAX_BUFFERS} inputs and outputs", stmt.pos)
                    value = self.expr(stmt.value, dtype)
                    if value.dtype is not dtype:
                        message = f"output {stmt.name!r} is {dtype} but its value is {value.dtype}"
                        raise self.error(f"{message}; cast it with {dtype}(...)", stmt.value.pos)
                    outputs.append(Output(stmt.name, dtype, value))
                    self.env[stmt.name] = value
        end = Pos(self.source.count("\n") + 1, len(self.source) - self.source.rfind("\n"))
        if not outputs:
            raise self.error("an epilogue needs at least one output ('out name = ...')", end)
        if not any(i.shape is Shape.FULL for i in inputs):
            raise self.error("an epilogue needs at least one full input ('in x: f32', shape [rows, cols])", end)
        return tuple(inputs), tuple(params), tuple(outputs)

    def storage_type(self, name: str, pos: Pos, what: str) -> DType:
        dtype = DType(name)
        if dtype not in STORAGE_TYPES:
            raise self.error(f"{what} are stored as f32 or i32; declare f32 and cast with {name}(...)", pos)
        return dtype

    # -- expressions ---------------------------------------------------------------

    def expr(self, expr: Expr, want: DType | None) -> Node:
        """The IR of `expr`; `want` is the type the context needs, which literals adopt."""
        match expr:
            case Num():
                return self.literal(
                    expr.value, expr.is_float, want or (DType.F32 if expr.is_float else DType.I32), expr.pos
                )
            case Name():
                return self.name(expr, want)
            case Unary(op="-", operand=Num(is_float=False) as number) if want in (DType.I32, None):
                # A negative integer literal, checked as one: i32's least value, -2147483648, is one.
                return self.literal(-number.value, False, DType.I32, number.pos)
            case Unary(op="-"):
                operand = self.expr(expr.operand, want)
                self.require_numeric(operand, expr.pos, "'-'")
                return self.arith("neg", operand)
            case Unary():
                return self.make(Op(DType.BOOL, "not", (self.boolean(expr.operand),)))
            case Binary(op="&&" | "||"):
                chain = _left_chain(expr, ("&&", "||"))
                value = self.boolean(chain[0].left)
                for link in chain:
                    op = "and" if link.op == "&&" else "or"
                    value = self.make(Op(DType.BOOL, op, (value, self.boolean(link.right))))
                return value
            case Binary() if expr.op in _COMPARE:
                left, right = self.unify([expr.left, expr.right], None, expr.pos)
                if expr.op not in ("==", "!="):
                    self.require_numeric(left, expr.pos, repr(expr.op))
                return self.make(Op(DType.BOOL, _COMPARE[expr.op], (left, right)))
            case Binary():
                return self.arithmetic(expr, want)
            case Call():
                return self.call(expr, want)
        raise AssertionError(expr)

    def name(self, expr: Name, want: DType | None) -> Node:
        if expr.name == "inf":
            dtype = want or DType.F32
            if not dtype.is_float:
                raise self.error(f"'inf' is a float where {dtype} is needed", expr.pos)
            return self.make(Const(dtype, _INF_BITS))
        if expr.name in ("row", "col", "rows", "cols"):
            return self.make(Index(DType.I32, expr.name))
        if expr.name not in self.env:
            raise self.error(f"undefined name {expr.name!r}", expr.pos)
        return self.env[expr.name]

    def literal(self, value: int | float, is_float: bool, dtype: DType, pos: Pos) -> Node:
        if dtype is DType.BOOL:
            raise self.error("a number where a bool is needed (compare it, or cast with bool(...))", pos)
        if dtype is DType.I32:
            if is_float:
                raise self.error("a float literal where an i32 is needed", pos)
            if not -(2**31) <= value < 2**31:
                raise self.error("integer literal out of range for i32", pos)
            return self.make(Const(dtype, int(value)))
        bits = float_bits(value, dtype)
        if bits is None:
            raise self.error(f"literal out of range for {dtype}", pos)
        return self.make(Const(dtype, bits))

    def arithmetic(self, expr: Binary, want: DType | None) -> Node:
        """A chain of `+ - * /` (`a * b + c - d`), typed link by link as `unify` types two operands, in one
        loop: literal operands take the type of the others, and literals alone take `want` or their own kind."""
        chain = _left_chain(expr, _ARITHMETIC)
        first = chain[0].left
        kind = literal_kind(first)
        value = None if kind is not None else self.expr(first, want)
        for k, link in enumerate(chain):
            right_kind = literal_kind(link.right)
            if value is None and right_kind is not None:  # literals so far: typed by the first other operand
                kind = _combine(kind, right_kind)
                continue
            if value is None:
                right = self.expr(link.right, want)
                left = self.literals(first, chain[:k], right.dtype)
            else:
                left, right = value, self.expr(link.right, want if right_kind is None else value.dtype)
                if right.dtype is not left.dtype:
                    message = f"operands have different types, {left.dtype} and {right.dtype}; cast one explicitly"
                    raise self.error(message, link.pos)
            value = self.binary(link, left, right)
        if value is None:
            return self.literals(first, chain, want or (DType.F32 if kind == "float" else DType.I32))
        return value

    def literals(self, first: Expr, chain: list[Binary], dtype: DType) -> Node:
        """The value of a chain of literal operands, every one of type `dtype`."""
        value = self.expr(first, dtype)
        for link in chain:
            value = self.binary(link, value, self.expr(link.right, dtype))
        return value

    def binary(self, link: Binary, left: Node, right: Node) -> Node:
        self.require_numeric(left, link.pos, repr(link.op))
        if link.op == "/" and not left.dtype.is_float:
            raise self.error("'/' needs float operands; cast integers with f32(...)", link.pos)
        if link.op == "/" and isinstance(right, Const) and right.value == 0:
            # IEEE gives infinity (or NaN); WGSL and SPIR-V leave it undefined: engines would differ
            raise self.error("division by zero", link.pos)
        return self.arith(_ARITHMETIC[link.op], left, right)

    def boolean(self, expr: Expr) -> Node:
        node = self.expr(expr, DType.BOOL)
        if node.dtype is not DType.BOOL:
            raise self.error(f"expected a bool, found {node.dtype}", expr.pos)
        return node

    def require_numeric(self, node: Node, pos: Pos, what: str) -> None:
        if node.dtype is DType.BOOL:
            raise self.error(f"{what} needs numbers, not bool", pos)

    def unify(self, exprs: list[Expr], want: DType | None, pos: Pos) -> list[Node]:
        """Check operands that must share one type; literal operands adopt the others' type."""
        kinds = [literal_kind(e) for e in exprs]
        nodes: dict[int, Node] = {}
        for i, (e, kind) in enumerate(zip(exprs, kinds, strict=True)):
            if kind is None:
                nodes[i] = self.expr(e, want)
        if nodes:
            dtype = next(iter(nodes.values())).dtype
            for node in nodes.values():
                if node.dtype is not dtype:
                    raise self.error(
                        f"operands have different types, {dtype} and {node.dtype}; cast one explicitly", pos
                    )
        else:
            dtype = want or (DType.F32 if "float" in kinds else DType.I32)
        return [nodes[i] if i in nodes else self.expr(e, dtype) for i, e in enumerate(exprs)]

    def call(self, expr: Call, want: DType | None) -> Node:
        name, args = expr.name, list(expr.args)
        if name in TYPE_NAMES:
            return self.cast_call(expr, DType(name))
        if name not in _ARITY:
            raise self.error(f"unknown function {name!r}", expr.pos)
        if len(args) != _ARITY[name]:
            plural = "s" if _ARITY[name] > 1 else ""
            raise self.error(f"{name} takes {_ARITY[name]} argument{plural}, got {len(args)}", expr.pos)
        if name in MATH_FUNCTIONS or name in COMPOSITE_FUNCTIONS:
            x = self.float_arg(args[0], want, name)
            return self.arith(name, x) if name in MATH_FUNCTIONS else self.composite(name, x)
        if name == "select":
            condition = self.boolean(args[0])
            a, b = self.unify(args[1:], want, expr.pos)
            return self.arith("select", condition, a, b)
        if name in REDUCTIONS:
            x = self.float_arg(args[0], want, name) if name == "row_mean" else self.expr(args[0], want)
            self.require_numeric(x, expr.pos, name)
            return self.reduction(name.removeprefix("row_"), x, expr.pos)
        values = self.unify(args, want, expr.pos)
        self.require_numeric(values[0], expr.pos, name)
        if name == "clamp":
            x, lo, hi = values
            return self.arith("min", self.arith("max", x, lo), hi)
        return self.arith(name, *values)

    def float_arg(self, arg: Expr, want: DType | None, function: str) -> Node:
        default = DType.F32 if literal_kind(arg) else None
        x = self.expr(arg, want or default)
        if not x.dtype.is_float:
            raise self.error(f"{function} needs a float argument, not {x.dtype}; cast with f32(...)", arg.pos)
        return x

    def cast_call(self, expr: Call, dtype: DType) -> Node:
        if len(expr.args) != 1:
            raise self.error(f"the cast {dtype}(...) takes 1 argument, got {len(expr.args)}", expr.pos)
        arg = expr.args[0]
        kind = literal_kind(arg)
        if kind and (dtype.is_float or (dtype is DType.I32 and kind == "int")):
            return self.expr(arg, dtype)  # a literal is rounded once, straight to the type
        return self.cast(self.expr(arg, None), dtype)

    # -- lowering ------------------------------------------------------------------

    def cast(self, node: Node, dtype: DType) -> Node:
        if node.dtype is dtype:
            return node
        if dtype in (DType.F16, DType.BF16) and not node.dtype.is_float:
            node = self.cast(node, DType.F32)
        return self.make(Op(dtype, "cast", (node,)))

    def arith(self, op: str, *args: Node) -> Node:
        """An operation on values of one type; f16/bf16 compute in f32 and round."""
        dtype = args[-1].dtype
        if dtype in (DType.F16, DType.BF16):
            return self.cast(self.make(Op(DType.F32, op, args)), dtype)
        return self.make(Op(dtype, op, args))

    def f32(self, value: float) -> Node:
        """A constant of the checker's own (in-range) numbers."""
        bits = float_bits(value, DType.F32)
        assert bits is not None
        return self.make(Const(DType.F32, bits))

    def composite(self, name: str, x: Node) -> Node:
        """sigmoid, silu, gelu, gelu_tanh: expanded in f32, rounded once to x's type."""
        v = self.cast(x, DType.F32)
        if name in ("gelu", "gelu_tanh"):
            if name == "gelu":
                shape = self.arith("erf", self.arith("mul", v, self.f32(0.7071067811865476)))
            else:
                cube = self.arith("mul", self.arith("mul", v, v), v)
                inner = self.arith("add", v, self.arith("mul", self.f32(0.044715), cube))
                shape = self.arith("tanh", self.arith("mul", self.f32(0.7978845608028654), inner))
            result = self.arith("mul", self.arith("mul", self.f32(0.5), v), self.arith("add", self.f32(1.0), shape))
        else:
            exp = self.arith("exp", self.arith("neg", v))
            result = self.arith("div", self.f32(1.0), self.arith("add", self.f32(1.0), exp))
            if name == "silu":
                result = self.arith("mul", v, result)
        return self.cast(result, x.dtype)

    def reduction(self, op: str, x: Node, pos: Pos) -> Node:
        """Floats reduce in f32 (row_mean as row_sum / cols), rounded back to x's type."""
        total = self.make(Reduce(DType.F32 if x.dtype.is_float else x.dtype, "sum" if op == "mean" else op, x))
        self.reductions.add(id(total))
        if len(self.reductions) > MAX_REDUCTIONS:
            raise self.error(f"an epilogue has at most {MAX_REDUCTIONS} row reductions", pos)
        if op == "mean":
            cols = self.cast(self.make(Index(DType.I32, "cols")), DType.F32)
            total = self.arith("div", total, cols)
        return self.cast(total, x.dtype)


def float_bits(value: int | float, dtype: DType) -> int | None:
    """The f32 bit pattern of `value` rounded (to nearest, ties to even) to `dtype`; None on overflow."""
    try:
        value = float(value)
        if math.isinf(value):
            return None
        if dtype is DType.F16:
            value = struct.unpack("<e", struct.pack("<e", value))[0]
        elif dtype is DType.BF16:
            value = _round_bf16(value)
        return struct.unpack("<I", struct.pack("<f", value))[0]
    except OverflowError:
        return None


def _round_bf16(value: float) -> float:
    """Round a double straight to bf16 (8 significant bits, f32's exponent range)."""
    if value == 0.0:
        return value
    _, exponent = math.frexp(value)
    quantum = math.ldexp(1.0, max(exponent, -125) - 8)
    rounded = round(value / quantum) * quantum  # round() ties to even
    if abs(rounded) > DType.BF16.largest:
        raise OverflowError
    return rounded
