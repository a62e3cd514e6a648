"""`pie eta`: print the kernel source an eta program renders to."""

from __future__ import annotations

from typing import Annotated

import typer

from . import TARGETS, EtaError, compile
from .stdlib import SOURCES
from ..cli_errors import fail, usage, utf8_argument


def eta_command(
    expr: Annotated[
        str, typer.Argument(help="eta source (statements separated by ';' or newlines), or a stdlib epilogue name")
    ],
    target: Annotated[str, typer.Option(help=f"one of: {', '.join(TARGETS)}")] = "cuda",
) -> None:
    """Compile an eta epilogue and print its kernel source for TARGET."""
    if target not in TARGETS:
        raise usage(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if expr.isidentifier() and expr not in SOURCES:  # a name, not a program: say which names there are
        raise usage(f"no stdlib epilogue is named {expr!r} (the stdlib: {', '.join(sorted(SOURCES))}); "
                   "or give eta source, statements separated by ';'")
    try:
        epilogue = compile(SOURCES.get(expr, utf8_argument(expr, "the eta source")))
    except (EtaError, ValueError) as error:
        raise fail(str(error)) from None
    typer.echo(epilogue.render(target).source, nl=False)
