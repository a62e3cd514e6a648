"""Hypothesis strategies for eta source: typed random programs, garbage and mutations.

Programs are mostly well typed (so most of them compile and exercise every renderer), with
an occasional deliberately mixed-type operand. User-visible text is made distinctive so
the tests can prove it never reaches generated source: names are capitalised and end in a
digit (no internal or target identifier looks like that), comments carry a marker, and
some number literals are spelled with redundant leading zeros.

Every choice is one `pick` (an integer draw): building strategies per choice made
generation the slowest part of the property test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hypothesis import strategies as st

T = TypeVar("T")
FLOATS = ("f32", "f16", "bf16")
NUMERIC = (*FLOATS, "i32")
TYPES = (*NUMERIC, "bool")
COMMENT_MARKER = "UserCommentText"
_NAME_STEMS = ("A", "Bq", "Gate", "Up", "X", "Kappa", "Z_z", "Rows", "Cols", "Inf", "Exp", "In", "Out", "Let", "P")
_MATH = (
    "exp",
    "exp2",
    "log",
    "log2",
    "sqrt",
    "rsqrt",
    "tanh",
    "sin",
    "cos",
    "erf",
    "floor",
    "ceil",
    "round",
    "sigmoid",
    "silu",
    "gelu",
    "gelu_tanh",
    "abs",
)
_FLOAT_LITERALS = ("0.5", "1.0", "2.5", "0.125", "3.0", "1.5e1", "7.5e-1", ".25", "4.", "1e-3", "0.1", "2.0e0")
_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
_GARBAGE = "abcfinoprstuxyz_0123456789.eE+-*/<>=!&|()[],:;# \n\t\"'{}\\$@%^~`é中\x00"


@dataclass
class Program:
    text: str
    names: list[str] = field(default_factory=list)  # identifiers declared so far
    spellings: list[str] = field(default_factory=list)  # literal spellings that must not leak


class _Builder:
    def __init__(self, draw) -> None:
        self.draw = draw
        self.vars: dict[str, list[str]] = {t: [] for t in TYPES}
        self.program = Program("")
        self.reductions = 0

    def pick(self, options: Sequence[T]) -> T:
        return options[self.draw(st.integers(0, len(options) - 1))]

    def name(self) -> str:
        name = f"{self.pick(_NAME_STEMS)}{len(self.program.names)}"
        self.program.names.append(name)
        return name

    def space(self) -> str:
        return self.pick(("", "", " ", "  ", "\n  "))

    def literal(self, kind: str) -> str:
        if kind == "int":
            text = str(self.pick(range(41)))
        else:
            text = self.pick(_FLOAT_LITERALS)
        if self.pick((False, False, False, True)):
            text = "000" + text
            self.program.spellings.append(text)
        return text

    def expr(self, dtype: str, depth: int) -> str:
        if dtype == "bool":
            return self.boolean(depth)
        options = ("leaf", "leaf")
        if depth > 0:
            options += ("binary", "unary", "call", "select", "cast", "minmax") + (
                ("reduce",) if self.reductions < 2 else ()
            )
        choice = self.pick(options)
        sub = depth - 1
        if choice == "leaf":
            return self.leaf(dtype)
        if choice == "binary":
            op = self.pick(("+", "-", "*", "/") if dtype in FLOATS else ("+", "-", "*"))
            # Rarely an operand of another type: that must be a clean EtaTypeError.
            other = dtype if self.pick(range(30)) else self.pick(NUMERIC)
            return f"({self.expr(dtype, sub)}{self.space()}{op} {self.expr(other, sub)})"
        if choice == "unary":
            return f"-{self.expr(dtype, sub)}" if self.pick((True, False)) else f"(-({self.expr(dtype, sub)}))"
        if choice == "call":
            if dtype in FLOATS:
                return f"{self.pick(_MATH)}({self.expr(dtype, sub)})"
            if self.pick((True, False)):
                return f"abs({self.expr(dtype, sub)})"
            return f"clamp({self.expr(dtype, sub)}, {self.expr(dtype, 0)}, {self.expr(dtype, 0)})"
        if choice == "minmax":
            return f"{self.pick(('min', 'max'))}({self.expr(dtype, sub)},{self.space()}{self.expr(dtype, sub)})"
        if choice == "select":
            return f"select({self.boolean(sub)}, {self.expr(dtype, sub)}, {self.expr(dtype, sub)})"
        if choice == "cast":
            return f"{dtype}({self.expr(self.pick([t for t in TYPES if t != dtype]), sub)})"
        self.reductions += 1
        ops = ("row_sum", "row_max", "row_min") + (("row_mean",) if dtype in FLOATS else ())
        return f"{self.pick(ops)}({self.expr(dtype, sub)})"

    def boolean(self, depth: int) -> str:
        if depth <= 0 or self.pick(range(4)) == 0:
            if self.vars["bool"] and self.pick((True, False)):
                return self.pick(self.vars["bool"])
            dtype = self.pick(NUMERIC)
            return f"({self.expr(dtype, 0)} {self.pick(_COMPARISONS)} {self.expr(dtype, 0)})"
        choice = self.pick(("and", "or", "not", "cmp", "cast"))
        if choice == "not":
            return f"!{self.boolean(depth - 1)}"
        if choice == "cmp":
            dtype = self.pick(NUMERIC)
            return f"({self.expr(dtype, depth - 1)} {self.pick(_COMPARISONS)} {self.expr(dtype, depth - 1)})"
        if choice == "cast":
            return f"bool({self.expr(self.pick(NUMERIC), depth - 1)})"
        return f"({self.boolean(depth - 1)} {'&&' if choice == 'and' else '||'} {self.boolean(depth - 1)})"

    def leaf(self, dtype: str) -> str:
        choices = ["literal"] + ["var"] * 3 * bool(self.vars[dtype])
        if dtype == "i32":
            choices.append("index")
        if dtype in FLOATS and not self.vars[dtype]:
            choices.append("cast")
        choice = self.pick(choices)
        if choice == "var":
            return self.pick(self.vars[dtype])
        if choice == "index":
            return self.pick(("row", "col", "rows", "cols"))
        if choice == "cast":
            return f"{dtype}({self.pick(self.vars['f32'])})"
        return self.literal("int" if dtype == "i32" or self.pick((True, False)) else "float")


@st.composite
def programs(draw) -> Program:
    """A random eta program, mostly well typed."""
    b = _Builder(draw)
    lines = []
    if b.pick((True, False)):
        lines.append(f"# {COMMENT_MARKER} */ \" {{ }} ` $(rm -rf) '")
    for _ in range(b.pick((1, 2, 3))):
        name = b.name()
        lines.append(f"in {name}: f32{b.pick(('', '', '[rows, cols]'))}")
        b.vars["f32"].append(name)
    shaped = b.pick((None, "i32", "cols", "rows"))
    if shaped:
        name = b.name()
        lines.append(f"in {name}: i32" if shaped == "i32" else f"in {name}: f32[{shaped}]")
        b.vars["i32" if shaped == "i32" else "f32"].append(name)
    for _ in range(b.pick((0, 1, 2))):
        dtype = b.pick(TYPES)
        name = b.name()
        lines.append(f"param {name}: {dtype}")
        b.vars[dtype].append(name)
    for _ in range(b.pick((0, 1, 2))):
        dtype = b.pick(TYPES)
        value = b.expr(dtype, b.pick((0, 1, 2, 3)))
        name = b.name()
        lines.append(f"let {name} = {value}  # {COMMENT_MARKER}")
        b.vars[dtype].append(name)
    for _ in range(b.pick((1, 2))):
        dtype = b.pick(("f32", "f32", "f32", "i32", *FLOATS))
        value = b.expr(dtype, b.pick((1, 2, 3, 3, 4)))
        if dtype in ("f16", "bf16"):
            value = f"f32({value})"
        annotation = {"f32": b.pick(("", ": f32")), "i32": ": i32"}.get(dtype, "")
        lines.append(f"out {b.name()}{annotation} = {value}")
    b.program.text = b.pick(("\n", "\n", "; ", "\n\n")).join(lines)
    return b.program


garbage = st.text(alphabet=_GARBAGE, max_size=80).map(Program)


@st.composite
def mutated(draw) -> Program:
    """A random program with a few characters inserted, deleted or replaced."""
    program = draw(programs())
    text = program.text
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.integers(0, 2))
        char = _GARBAGE[draw(st.integers(0, len(_GARBAGE) - 1))]
        text = text[:at] + char + text[at + (edit > 0) :] if edit else text[:at] + text[at + 1 :]
    return Program(text, program.names, program.spellings)


sources = st.one_of(programs(), programs(), programs(), programs(), garbage, mutated())
