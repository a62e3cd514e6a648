"""The typed eta IR: a hash-consed DAG of value nodes.

The checker lowers the surface language to a small set of primitives: every arithmetic
`Op` computes in f32, i32 or bool, and f16/bf16 values appear only as results of `cast`
(rounding) or as constants. Nodes are interned by a `Graph`, so structurally equal nodes
are the same object: identity equality gives common-subexpression elimination for free
and keeps hashing O(1).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .types import DType, Shape

# Primitive operations and the operand kinds they accept ('f' float carrier, 'i' i32, 'b' bool).
ARITHMETIC = ("add", "sub", "mul", "div", "min", "max")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
LOGIC = ("and", "or", "not")
UNARY = ("neg", "abs")
REDUCE_OPS = ("sum", "max", "min")


@dataclass(frozen=True, eq=False)
class Node:
    dtype: DType

    @property
    def args(self) -> tuple[Node, ...]:
        return ()


@dataclass(frozen=True, eq=False)
class Const(Node):
    raw: int  # f32 bit pattern for float types (already rounded to the type), else the value

    @property
    def value(self) -> float | int | bool:
        if self.dtype.is_float:
            return struct.unpack("<f", struct.pack("<I", self.raw))[0]
        return bool(self.raw) if self.dtype is DType.BOOL else self.raw


@dataclass(frozen=True, eq=False)
class Load(Node):
    name: str
    shape: Shape


@dataclass(frozen=True, eq=False)
class ParamRef(Node):
    name: str


@dataclass(frozen=True, eq=False)
class Index(Node):
    which: str  # 'row' | 'col' | 'rows' | 'cols'


@dataclass(frozen=True, eq=False)
class Op(Node):
    op: str  # ARITHMETIC, COMPARISONS, LOGIC, UNARY, math function names, 'select' or 'cast'
    operands: tuple[Node, ...]

    @property
    def args(self) -> tuple[Node, ...]:
        return self.operands


@dataclass(frozen=True, eq=False)
class Reduce(Node):
    """A reduction over the row's columns; its value is uniform across the row."""

    op: str  # REDUCE_OPS
    operand: Node

    @property
    def args(self) -> tuple[Node, ...]:
        return (self.operand,)


class Graph:
    """Interns nodes: building the same node twice returns the first object."""

    def __init__(self) -> None:
        self._nodes: dict[tuple, Node] = {}

    def intern(self, node: Node) -> Node:
        fields = tuple(getattr(node, name) for name in node.__dataclass_fields__ if name not in ("operands", "operand"))
        key = (type(node), fields, tuple(id(arg) for arg in node.args))
        return self._nodes.setdefault(key, node)


# -- declarations --------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    name: str
    dtype: DType  # a storage type
    shape: Shape


@dataclass(frozen=True)
class Param:
    name: str
    dtype: DType


@dataclass(frozen=True)
class Output:
    name: str
    dtype: DType  # a storage type; outputs are always [rows, cols]
    value: Node


def postorder(roots: Iterable[Node], leaves: tuple[type, ...] = ()) -> Iterator[Node]:
    """Every node reachable from `roots` once, operands before users, in a fixed order.

    Nodes of the `leaves` types are yielded without visiting their operands. Iterative,
    so DAGs built from long `let` chains cannot exhaust the Python stack.
    """
    done: set[int] = set()
    for root in roots:
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, next_arg = stack.pop()
            if id(node) in done:
                continue
            if next_arg < len(node.args) and not isinstance(node, leaves):
                stack.append((node, next_arg + 1))
                stack.append((node.args[next_arg], 0))
            else:
                done.add(id(node))
                yield node


def describe(node: Node, names: dict[int, str]) -> str:
    """One line of the canonical IR text for `node`, with operands named by `names`."""
    args = " ".join(names[id(arg)] for arg in node.args)
    match node:
        case Const():
            detail = f"0x{node.raw & 0xFFFFFFFF:08x}" if node.dtype.is_float else str(node.value).lower()
        case Load():
            detail = f"{node.name}[{node.shape}]"
        case ParamRef():
            detail = node.name
        case Index():
            detail = node.which
        case Op():
            detail = f"{node.op} {args}"
        case Reduce():
            detail = f"row_{node.op} {args}"
    return f"{type(node).__name__.lower()}.{node.dtype} {detail}"
