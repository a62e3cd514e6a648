"""The eta syntax tree: what the parser produces and the checker consumes.

Nodes keep the 1-based position of the token that introduced them so that type errors
can point at the right column.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pos:
    line: int
    column: int


# -- expressions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    value: int | float  # parsed value; the source text is never kept
    is_float: bool
    pos: Pos


@dataclass(frozen=True)
class Name:
    name: str
    pos: Pos


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Expr, ...]
    pos: Pos


@dataclass(frozen=True)
class Unary:
    op: str  # '-' or '!'
    operand: Expr
    pos: Pos


@dataclass(frozen=True)
class Binary:
    op: str
    left: Expr
    right: Expr
    pos: Pos  # position of the operator


Expr = Num | Name | Call | Unary | Binary


# -- statements ------------------------------------------------------------------------


@dataclass(frozen=True)
class InputDecl:
    name: str
    dtype: str
    shape: str  # 'rows,cols' | 'cols' | 'rows'
    pos: Pos
    type_pos: Pos


@dataclass(frozen=True)
class ParamDecl:
    name: str
    dtype: str
    pos: Pos


@dataclass(frozen=True)
class Let:
    name: str
    value: Expr
    pos: Pos


@dataclass(frozen=True)
class OutDecl:
    name: str
    dtype: str | None  # None: f32
    value: Expr
    pos: Pos
    type_pos: Pos | None


Stmt = InputDecl | ParamDecl | Let | OutDecl
