"""Tokens of eta source.

Newlines end statements except inside parentheses or brackets, where an expression may
continue on the next line. `#` starts a comment that runs to the end of the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import EtaSyntaxError

MAX_SOURCE_LENGTH = 65536

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r]+)
  | (?P<comment>\#[^\n]*)
  | (?P<newline>\n)
  | (?P<float>(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)
  | (?P<int>[0-9]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>&&|\|\||==|!=|<=|>=|[-+*/<>!=(),:;\[\]])
    """,
    re.VERBOSE | re.ASCII,
)
_OPEN, _CLOSE = "([", ")]"


@dataclass(frozen=True)
class Token:
    kind: str  # 'name' | 'int' | 'float' | 'op' | 'newline' | 'eof'
    text: str
    line: int
    column: int


def tokenize(source: str) -> list[Token]:
    if len(source) > MAX_SOURCE_LENGTH:
        raise EtaSyntaxError(f"source is longer than {MAX_SOURCE_LENGTH} characters", source)
    tokens: list[Token] = []
    line, line_start, depth, pos = 1, 0, 0, 0
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        column = pos - line_start + 1
        if match is None:
            hint = "; statements are separated by ';' or newlines" if source.startswith("\\n", pos) else ""
            raise EtaSyntaxError(f"unexpected character {source[pos]!r}{hint}", source, line, column)
        kind, text = match.lastgroup or "", match.group()
        pos = match.end()
        if kind in ("int", "float") and pos < len(source) and (source[pos].isalnum() or source[pos] in "_."):
            raise EtaSyntaxError("malformed number", source, line, column)
        if kind == "newline":
            if depth == 0:
                tokens.append(Token("newline", text, line, column))
            line, line_start = line + 1, pos
        elif kind == "op":
            depth = max(0, depth + (text in _OPEN) - (text in _CLOSE))
            tokens.append(Token(kind, text, line, column))
        elif kind not in ("space", "comment"):
            tokens.append(Token(kind, text, line, column))
    tokens.append(Token("eof", "", line, len(source) - line_start + 1))
    return tokens
