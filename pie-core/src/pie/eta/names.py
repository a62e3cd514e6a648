"""Reserved words and the rule for user identifiers.

User identifiers only ever reach generated source behind a prefix (`in_`, `out_`, `p_`),
so the rule here is what keeps every rendering a valid identifier in every target
language: ASCII letters, digits and single underscores, starting with a letter.
"""

from __future__ import annotations

import re

from .types import DType

MAX_NAME_LENGTH = 64

KEYWORDS = frozenset({"in", "param", "let", "out"})
TYPE_NAMES = frozenset(t.value for t in DType)
# Values every program can read: the element's row and column, the sizes, and infinity.
BUILTIN_VALUES = frozenset({"row", "col", "rows", "cols", "inf"})
# Elementwise functions on floats, evaluated by the target's math library.
MATH_FUNCTIONS = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sin", "cos", "erf", "floor", "ceil", "round")
# Functions the checker expands into primitive operations.
COMPOSITE_FUNCTIONS = ("sigmoid", "silu", "gelu", "gelu_tanh")
REDUCTIONS = ("row_sum", "row_max", "row_min", "row_mean")
OTHER_FUNCTIONS = ("abs", "min", "max", "clamp", "select")
FUNCTIONS = frozenset(MATH_FUNCTIONS + COMPOSITE_FUNCTIONS + REDUCTIONS + OTHER_FUNCTIONS)

RESERVED = KEYWORDS | TYPE_NAMES | BUILTIN_VALUES | FUNCTIONS

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*", re.ASCII)


def identifier_problem(name: str) -> str | None:
    """Why `name` cannot name an input, param, let or output; None when it can."""
    if not _IDENTIFIER.fullmatch(name):
        return f"invalid name {name!r}: names start with a letter and use ASCII letters, digits and '_'"
    if "__" in name:
        return f"invalid name {name!r}: '__' is reserved for generated code"
    if len(name) > MAX_NAME_LENGTH:
        return f"name is longer than {MAX_NAME_LENGTH} characters"
    if name in RESERVED:
        return f"{name!r} is reserved"
    return None
