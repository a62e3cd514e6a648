"""`pie model ...`: pull, list and import models in the local store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .errors import ModelLoadError, ModelStoreError
from .store import DEFAULT_MODEL, import_model, list_models, pull_model, store_dir

model_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Pull, list and import models.")


def _fail(exc: Exception) -> typer.Exit:
    typer.secho(f"pie: {exc}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


def _size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


@model_app.command()
def pull(
    name: Annotated[str, typer.Argument(help="A known model.")] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", help="Download again even if it is in the store.")] = False,
) -> None:
    """Download a known model into the store."""
    try:
        stored = pull_model(name, force=force)
    except ModelStoreError as exc:
        raise _fail(exc) from exc
    typer.echo(f"{stored.name}: {stored.path} ({_size(stored.size)})")


@model_app.command("list")
def list_() -> None:
    """Show the models in the store."""
    models = list_models()
    if not models:
        typer.echo(f"no models in {store_dir()} (try `pie model pull`)")
        return
    width = max(len(m.name) for m in models)
    for model in models:
        typer.echo(f"{model.name:<{width}}  {_size(model.size):>9}  {model.path}")


@model_app.command("import")
def import_(
    path: Annotated[Path, typer.Argument(help="A GGUF file or a Hugging Face model folder.")],
    name: Annotated[str | None, typer.Option("--name", help="Name in the store (default: from the path).")] = None,
    link: Annotated[bool, typer.Option("--link", help="Link to the model instead of copying it.")] = False,
) -> None:
    """Check that a model loads, then add it to the store."""
    try:
        stored = import_model(path, name, link=link)
    except (ModelStoreError, ModelLoadError) as exc:
        raise _fail(exc) from exc
    typer.echo(f"{stored.name}: {stored.path} ({_size(stored.size)})")
