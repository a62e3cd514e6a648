"""Whether a source is an inferlet (Python, with a top-level ``async def main``), read with ``ast`` alone.

The server reads the files of ``--inferlets DIR`` with :func:`inferlet_tree` when it starts. An uploaded source
it reads in a short-lived child process that runs this file as its script (``python -I -S -c TEXT``, the source
on stdin, the answer as JSON on stdout): parsing a source of a megabyte holds the GIL for seconds, which in the
server's process would stall every request and stream. So this module imports nothing of pie's.
"""

from __future__ import annotations

import ast


def inferlet_tree(source: str | bytes, filename: str) -> ast.Module:
    """The parsed source of an inferlet; ValueError saying why it is none (not Python, no ``async def main``)."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:  # a NUL byte too, without a line
        line = f" (line {exc.lineno})" if exc.lineno else ""
        raise ValueError(f"cannot be read as Python: {exc.msg}{line}") from None
    except ValueError as exc:  # a NUL byte, before Python 3.11.4
        raise ValueError(f"cannot be read as Python: {exc}") from None
    except (RecursionError, MemoryError):  # the parser's stack, or the tree's construction, ran out
        raise ValueError("cannot be read as Python: too deeply nested to parse") from None
    if not any(isinstance(node, ast.AsyncFunctionDef) and node.name == "main" for node in tree.body):
        raise ValueError("defines no `async def main(ctx, args)`")
    return tree


def answer_check() -> None:
    """The child's part: the source (UTF-8) on stdin, its file name and the address space
    the child may map (bytes) as arguments; prints ``{"problem": null}`` or ``{"problem": "why it is none"}``."""
    import json
    import resource
    import sys

    filename, memory_bytes = sys.argv[1], int(sys.argv[2])
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        memory_bytes = min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
    source = sys.stdin.buffer.read().decode()
    try:
        inferlet_tree(source, filename)
    except ValueError as exc:
        json.dump({"problem": str(exc)}, sys.stdout)
    else:
        json.dump({"problem": None}, sys.stdout)


if __name__ == "__main__":
    answer_check()
