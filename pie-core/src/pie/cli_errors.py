"""How every `pie` command reports what a user got wrong: one red line on stderr, exit status 1."""

from __future__ import annotations

import typer


def fail(message: object) -> typer.Exit:
    """Print ``pie: MESSAGE`` and return the Exit to raise (``raise fail(...) from exc``)."""
    typer.secho(f"pie: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)
