"""Errors raised while compiling eta source.

Every error carries the 1-based line and column of the offending text and renders the
source line with a caret under that column, so a CLI user sees exactly what was rejected.
"""

from __future__ import annotations

EXCERPT_WIDTH = 80  # columns of a long line shown around the caret


class EtaError(Exception):
    """Base class of everything `pie.eta.compile` raises for bad input."""

    def __init__(self, message: str, source: str = "", line: int = 1, column: int = 1) -> None:
        self.message = message
        self.source = source
        self.line = line
        self.column = column
        super().__init__(self._display())

    def _display(self) -> str:
        # Lines as the lexer counts them: only "\n" ends one (a comment may hold "\r", "\x85" or U+2028).
        lines = self.source.split("\n")
        text = lines[self.line - 1].removesuffix("\r") if 0 < self.line <= len(lines) else ""
        start = 0
        if len(text) > EXCERPT_WIDTH:  # a window around the caret, not the whole line
            start = min(max(0, self.column - 1 - EXCERPT_WIDTH // 2), len(text) - EXCERPT_WIDTH)
            end = start + EXCERPT_WIDTH
            text = ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")
            start -= 3 if start else 0
        # Non-printable characters would shift the caret; show them as '?'.
        text = "".join(ch if ch.isprintable() else "?" for ch in text)
        caret = " " * (self.column - 1 - start) + "^"
        return f"line {self.line}, column {self.column}: {self.message}\n  {text}\n  {caret}"


class EtaSyntaxError(EtaError):
    """The text is not a well-formed eta program (lexing, grammar, reserved names, limits)."""


class EtaTypeError(EtaError):
    """The program is well formed but names, types or shapes do not check."""
