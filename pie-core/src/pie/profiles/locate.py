"""Line numbers for keys of a TOML text, which :mod:`tomllib` does not report for values.

:func:`key_lines` scans a text that already parsed as TOML and maps every key
path to the line where it is defined: ``("kernels", "linear", "buckets", 2,
"rows")`` for the ``rows`` key of the third ``[[kernels.linear.buckets]]``.
Values inside inline tables and arrays map to the line of their key. The scan
is best effort and never raises: a line it cannot read simply maps nothing.
"""

from __future__ import annotations

import json

Path = tuple[str | int, ...]

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _quoted(text: str, start: int) -> tuple[str, int] | None:
    """A quoted key starting at ``text[start]``: its value and the index after it."""
    quote = text[start]
    i = start + 1
    while i < len(text):
        char = text[i]
        if quote == '"' and char == "\\":
            i += 2
            continue
        if char == quote:
            raw = text[start + 1 : i]
            if quote == '"':
                try:
                    raw = json.loads(f'"{raw}"')
                except ValueError:
                    pass
            return raw, i + 1
        i += 1
    return None


def _dotted_key(text: str, start: int = 0) -> tuple[list[str], int] | None:
    """A dotted key at ``text[start:]``: its parts and the index after it (whitespace skipped)."""
    parts: list[str] = []
    i = start
    while True:
        while i < len(text) and text[i] in " \t":
            i += 1
        if i >= len(text):
            return None
        if text[i] in "\"'":
            found = _quoted(text, i)
            if found is None:
                return None
            part, i = found
        else:
            j = i
            while j < len(text) and text[j] in _BARE:
                j += 1
            if j == i:
                return None
            part, i = text[i:j], j
        parts.append(part)
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == ".":
            i += 1
            continue
        return parts, i


class _ValueScanner:
    """Tracks strings and brackets across lines, to know when a multi-line value ends."""

    def __init__(self) -> None:
        self.multiline: str | None = None
        self.depth = 0

    @property
    def inside(self) -> bool:
        return self.multiline is not None or self.depth > 0

    def feed(self, line: str, start: int = 0) -> None:
        i = start
        while i < len(line):
            if self.multiline is not None:
                end = line.find(self.multiline, i)
                if end < 0:
                    return
                i = end + 3
                self.multiline = None
                continue
            char = line[i]
            if char == "#":
                return
            if line.startswith('"""', i) or line.startswith("'''", i):
                self.multiline = line[i : i + 3]
                i += 3
            elif char in "\"'":
                found = _quoted(line, i)
                if found is None:
                    return
                i = found[1]
            else:
                if char in "[{":
                    self.depth += 1
                elif char in "]}":
                    self.depth = max(0, self.depth - 1)
                i += 1


def key_lines(text: str) -> dict[Path, int]:
    """Every key path of ``text`` (and every table header) with its 1-based line number."""
    lines: dict[Path, int] = {}
    table: Path = ()
    arrays: dict[Path, int] = {}
    scanner = _ValueScanner()

    def resolve(keys: list[str], is_array: bool) -> Path:
        path: Path = ()
        for index, key in enumerate(keys):
            path = (*path, key)
            last = index == len(keys) - 1
            if path in arrays and not (last and is_array):
                path = (*path, arrays[path])
        return path

    for number, line in enumerate(text.split("\n"), start=1):
        if scanner.inside:
            scanner.feed(line)
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("["):
            is_array = stripped.startswith("[[")
            found = _dotted_key(stripped, 2 if is_array else 1)
            if found is None:
                continue
            path = resolve(found[0], is_array)
            if is_array:
                arrays[path] = arrays.get(path, -1) + 1
                path = (*path, arrays[path])
            table = path
            lines.setdefault(table, number)
            continue
        found = _dotted_key(line)
        if found is None:
            continue
        keys, after = found
        equals = line.find("=", after)
        if equals < 0:
            continue
        lines.setdefault((*table, *keys), number)
        scanner.feed(line, equals + 1)
    return lines


def line_of(lines: dict[Path, int], path: Path) -> int | None:
    """The line of ``path``, or of its longest prefix that has one."""
    for end in range(len(path), 0, -1):
        found = lines.get(path[:end])
        if found is not None:
            return found
    return None


def format_path(path: Path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"
