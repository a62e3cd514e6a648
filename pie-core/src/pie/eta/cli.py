"""`pie eta`: print the kernel source an eta program renders to."""

from __future__ import annotations

from typing import Annotated

import typer

from . import TARGETS, EtaError, compile
from .stdlib import SOURCES


def eta_command(
    expr: Annotated[
        str, typer.Argument(help="eta source (statements separated by ';' or newlines), or a stdlib epilogue name")
    ],
    target: Annotated[str, typer.Option(help=f"one of: {', '.join(TARGETS)}")] = "cuda",
) -> None:
    """Compile an eta epilogue and print its kernel source for TARGET."""
    if target not in TARGETS:
        typer.echo(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}", err=True)
        raise typer.Exit(2)
    try:
        epilogue = compile(SOURCES.get(expr, expr))
    except EtaError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(1) from None
    typer.echo(epilogue.render(target).source, nl=False)
