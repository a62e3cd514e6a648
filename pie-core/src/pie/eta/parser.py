"""Recursive-descent parser for eta.

Grammar (EBNF; `NEWLINE` and `;` both separate statements)::

    program  = { sep } [ stmt { sep { sep } stmt } ] { sep } EOF
    sep      = NEWLINE | ";"
    stmt     = "in" NAME ":" type [ "[" dims "]" ]
             | "param" NAME ":" type
             | "let" NAME "=" expr
             | "out" NAME [ ":" type ] "=" expr
    dims     = "rows" "," "cols" | "cols" | "rows"
    type     = "f32" | "f16" | "bf16" | "i32" | "bool"
    expr     = and { "||" and }
    and      = cmp { "&&" cmp }
    cmp      = sum [ ( "==" | "!=" | "<" | "<=" | ">" | ">=" ) sum ]
    sum      = term { ( "+" | "-" ) term }
    term     = unary { ( "*" | "/" ) unary }
    unary    = ( "-" | "!" ) unary | primary
    primary  = INT | FLOAT | NAME [ "(" [ expr { "," expr } ] ")" ] | "(" expr ")"

Comparisons do not chain. Expressions nest (parentheses, calls, prefix operators, right
operands) at most `MAX_DEPTH` levels deep so that no later pass can exhaust Python's stack;
a flat chain of left-associative operators (`a + b + c + ...`) is one level at any length.
"""

from __future__ import annotations

from .errors import EtaSyntaxError
from .lexer import Token, tokenize
from .names import KEYWORDS, TYPE_NAMES, identifier_problem
from .syntax import Binary, Call, Expr, InputDecl, Let, Name, Num, OutDecl, ParamDecl, Pos, Stmt, Unary

MAX_DEPTH = 64
# An integer literal of more significant digits is at least 10**39, beyond every eta type (f32's largest is 3.4e38);
# refusing it here also keeps `int()` clear of Python's limit on digits.
MAX_INT_DIGITS = 39

_COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")
_PRECEDENCE = {"||": 0, "&&": 1, **dict.fromkeys(_COMPARISONS, 2), "+": 3, "-": 3, "*": 4, "/": 4}
_SHAPES = {("rows", ",", "cols"): "rows,cols", ("cols",): "cols", ("rows",): "rows"}


def parse(source: str) -> list[Stmt]:
    """Parse eta source into statements; raises EtaSyntaxError."""
    return _Parser(source).program()


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.tokens = tokenize(source)
        self.index = 0
        self.depths: dict[int, int] = {}  # id(expr) -> tree depth, for the depth limit
        self.nesting = 0  # open parentheses, calls and prefix operators: bounds recursion here

    # -- token helpers -------------------------------------------------------------

    @property
    def token(self) -> Token:
        return self.tokens[self.index]

    def error(self, message: str, token: Token | None = None) -> EtaSyntaxError:
        token = token or self.token
        return EtaSyntaxError(message, self.source, token.line, token.column)

    def advance(self) -> Token:
        token = self.token
        self.index += 1
        return token

    def at(self, *texts: str) -> bool:
        return self.token.kind in ("op", "name") and self.token.text in texts

    def expect(self, text: str) -> Token:
        if not self.at(text):
            raise self.error(f"expected {text!r}, found {_describe(self.token)}")
        return self.advance()

    def at_separator(self) -> bool:
        return self.token.kind == "newline" or self.at(";")

    # -- statements ----------------------------------------------------------------

    def program(self) -> list[Stmt]:
        statements: list[Stmt] = []
        while True:
            while self.at_separator():
                self.advance()
            if self.token.kind == "eof":
                return statements
            statements.append(self.statement())
            if not (self.at_separator() or self.token.kind == "eof"):
                raise self.error(f"expected end of statement, found {_describe(self.token)}")

    def statement(self) -> Stmt:
        keyword = self.token
        if keyword.kind != "name" or keyword.text not in KEYWORDS:
            raise self.error(f"expected a statement ('in', 'param', 'let' or 'out'), found {_describe(keyword)}")
        self.advance()
        name_token = self.token
        name = self.declared_name()
        pos = _pos(name_token)
        if keyword.text == "in":
            self.expect(":")
            input_type_pos = _pos(self.token)
            input_type = self.type_name()
            return InputDecl(name, input_type, self.shape() if self.at("[") else "rows,cols", pos, input_type_pos)
        if keyword.text == "param":
            self.expect(":")
            return ParamDecl(name, self.type_name(), pos)
        if keyword.text == "let":
            self.expect("=")
            return Let(name, self.expression(), pos)
        dtype: str | None = None
        type_pos: Pos | None = None
        if self.at(":"):
            self.advance()
            type_pos = _pos(self.token)
            dtype = self.type_name()
        self.expect("=")
        return OutDecl(name, dtype, self.expression(), pos, type_pos)

    def declared_name(self) -> str:
        token = self.token
        if token.kind != "name":
            raise self.error(f"expected a name, found {_describe(token)}")
        problem = identifier_problem(token.text)
        if problem:
            raise self.error(problem)
        return self.advance().text

    def type_name(self) -> str:
        if self.token.kind != "name" or self.token.text not in TYPE_NAMES:
            raise self.error(f"expected a type (f32, f16, bf16, i32, bool), found {_describe(self.token)}")
        return self.advance().text

    def shape(self) -> str:
        self.expect("[")
        start = self.token
        words: list[str] = []
        while not self.at("]") and self.token.kind != "eof" and len(words) < 3:
            words.append(self.advance().text)
        shape = _SHAPES.get(tuple(words))
        if shape is None or not self.at("]"):
            raise self.error("expected a shape: [rows, cols], [cols] or [rows]", start)
        self.advance()
        return shape

    # -- expressions ---------------------------------------------------------------

    def expression(self) -> Expr:
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise self.error(f"expression nested deeper than {MAX_DEPTH} levels")
        expr = self.binary(0)
        self.nesting -= 1
        return expr

    def binary(self, min_precedence: int) -> Expr:
        """Precedence climbing over `_PRECEDENCE`; all binary operators are left-associative."""
        left = self.unary()
        while (precedence := _precedence(self.token)) is not None and precedence >= min_precedence:
            op_token = self.advance()
            right = self.binary(precedence + 1)
            left = self.node(Binary(op_token.text, left, right, _pos(op_token)), right, chained=left)
            if op_token.text in _COMPARISONS and self.token.kind == "op" and self.token.text in _COMPARISONS:
                raise self.error("comparisons do not chain; combine them with '&&'")
        return left

    def unary(self) -> Expr:
        if self.token.kind == "op" and self.token.text in ("-", "!"):
            op_token = self.advance()
            self.nesting += 1
            if self.nesting > MAX_DEPTH:
                raise self.error(f"expression nested deeper than {MAX_DEPTH} levels", op_token)
            operand = self.unary()
            self.nesting -= 1
            return self.node(Unary(op_token.text, operand, _pos(op_token)), operand)
        return self.primary()

    def primary(self) -> Expr:
        token = self.token
        if token.kind == "int":
            digits = token.text.lstrip("0") or "0"
            if len(digits) > MAX_INT_DIGITS:
                raise self.error("integer literal out of range")
            self.advance()
            return self.node(Num(int(digits), False, _pos(token)))
        if token.kind == "float":
            self.advance()
            return self.node(Num(float(token.text), True, _pos(token)))
        if self.at("("):
            self.advance()
            inner = self.expression()
            self.expect(")")
            return inner
        if token.kind != "name":
            raise self.error(f"expected an expression, found {_describe(token)}")
        if token.text in KEYWORDS:
            raise self.error(f"unexpected keyword {token.text!r}")
        self.advance()
        if not self.at("("):
            if token.text in TYPE_NAMES:
                raise self.error(f"a type name is not a value; write a cast like {token.text}(x)", token)
            return self.node(Name(token.text, _pos(token)))
        self.advance()
        args: list[Expr] = []
        if not self.at(")"):
            args.append(self.expression())
            while self.at(","):
                self.advance()
                args.append(self.expression())
        self.expect(")")
        return self.node(Call(token.text, tuple(args), _pos(token)), *args)

    def node(self, expr: Expr, *nested: Expr, chained: Expr | None = None) -> Expr:
        """Record the depth of `expr`: one more than its deepest `nested` operand's. A binary operator's left
        operand (`chained`) is no deeper nesting: a flat chain `a + b + c + ...` counts one level however
        long it is, and later passes walk such chains in a loop."""
        depth = 1 + max((self.depths[id(child)] for child in nested), default=0)
        if chained is not None:
            depth = max(depth, self.depths[id(chained)])
        if depth > MAX_DEPTH:
            raise EtaSyntaxError(
                f"expression nested deeper than {MAX_DEPTH} levels", self.source, expr.pos.line, expr.pos.column
            )
        self.depths[id(expr)] = depth
        return expr


def _pos(token: Token) -> Pos:
    return Pos(token.line, token.column)


def _precedence(token: Token) -> int | None:
    return _PRECEDENCE.get(token.text) if token.kind == "op" else None


def _describe(token: Token) -> str:
    if token.kind == "eof":
        return "end of input"
    if token.kind == "newline":
        return "end of line"
    return repr(token.text)
