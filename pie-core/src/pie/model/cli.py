"""`pie model ...`: pull, list, verify, import and remove models in the local store."""

from __future__ import annotations

from typing import Annotated

import typer

from pie.cli_errors import fail, path_argument

from .errors import ModelLoadError
from .store import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    StoredModel,
    import_model,
    is_verifiable,
    list_models,
    pull_model,
    remove_model,
    store_dir,
    tidy_store,
    verify_model,
)

model_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Pull, list, verify, import and remove models.")


def _size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


@model_app.command()
def pull(
    name: Annotated[str, typer.Argument(help="A known model.")] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", help="Download again even if it is in the store.")] = False,
) -> None:
    """Download a known model into the store, or again if what is there fails its checksum."""
    try:
        stored = pull_model(name, force=force)
    except OSError as exc:
        raise fail(exc) from exc
    typer.echo(f"{stored.name}: {stored.path} ({_size(stored.size)})")


def _repair(model: StoredModel) -> str:
    if model.name in KNOWN_MODELS:
        return f"`pie model pull {model.name}` fetches it again"
    return (f"`pie model import PATH --name {model.name} --force` imports it again, `pie model remove {model.name}` "
            "removes it")


@model_app.command("list")
def list_() -> None:
    """Show the models in the store (sizes checked; `pie model verify` checks their contents)."""
    try:
        removed = tidy_store()
        models = list_models()
    except OSError as exc:
        raise fail(exc) from exc
    if removed:
        typer.echo(f"removed {len(removed)} staging folder(s) that a pull, import or remove stopped midway left in "
                   f"{store_dir()}: {', '.join(removed)}", err=True)
    if not models:
        typer.echo(f"no models in {store_dir()} (try `pie model pull`)")
        return
    width = max(len(m.name) for m in models)
    for model in models:
        damaged = f"  DAMAGED: {model.problem}; {_repair(model)}" if model.problem else ""
        typer.echo(f"{model.name:<{width}}  {_size(model.size):>9}  {model.path}{damaged}")


@model_app.command()
def verify(
    name: Annotated[str | None, typer.Argument(help="A model in the store (default: all of them).")] = None,
) -> None:
    """Check each model's files against their recorded sizes and sha256; exit 1 if any is damaged."""
    try:
        names = [name] if name is not None else [m.name for m in list_models()]
        damaged = 0
        for entry in names:
            model = verify_model(entry)
            if model.problem is not None:
                damaged += 1
                typer.secho(f"{entry}: DAMAGED: {model.problem}; {_repair(model)}", fg=typer.colors.RED)
            elif is_verifiable(entry):
                typer.echo(f"{entry}: ok")
            else:
                typer.echo(f"{entry}: not verified: nothing recorded to check it against (a linked model, "
                           "or one imported by an older pie)")
    except OSError as exc:
        raise fail(exc) from exc
    if not names:
        typer.echo(f"no models in {store_dir()}")
    if damaged:
        raise typer.Exit(1)


@model_app.command("import")
def import_(
    path: Annotated[str, typer.Argument(help="A GGUF file or a Hugging Face model folder.")],
    name: Annotated[str | None, typer.Option("--name", help="Name in the store (default: from the path).")] = None,
    link: Annotated[bool, typer.Option("--link", help="Link to the model instead of copying it.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a model of that name in the store (once the new "
                                                         "one is whole; a failed import leaves it).")] = False,
) -> None:
    """Check that a model loads, then add it to the store."""
    path_argument(path, "the path", "a GGUF file or a Hugging Face model's folder to import")
    try:
        stored = import_model(path, name, link=link, force=force)
    except (OSError, ModelLoadError) as exc:
        raise fail(exc) from exc
    typer.echo(f"{stored.name}: {stored.path} ({_size(stored.size)})")


@model_app.command()
def remove(
    names: Annotated[list[str], typer.Argument(metavar="NAME",
                                               help="Models in the store, as `pie model list` names them.")],
) -> None:
    """Remove models from the store, damaged ones too (a linked model: the link only); exit 1 if any could not be."""
    failed = 0
    for name in dict.fromkeys(names):
        try:
            removed = remove_model(name)
        except OSError as exc:
            failed += 1
            fail(exc)
            continue
        if removed.linked_to is not None:
            typer.echo(f"{name}: removed (a link: {removed.linked_to} is left as it is)")
        else:
            typer.echo(f"{name}: removed ({_size(removed.freed)} freed)")
    if failed:
        raise typer.Exit(1)
