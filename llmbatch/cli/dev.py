"""``llm-batch dev up|down|status|tiny-model``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from llmbatch.config import Settings

app = typer.Typer(no_args_is_help=True)


@app.command("up")
def up(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Start Temporal (with Web UI), Postgres and S3 on 127.0.0.1; a no-op if running."""
    from llmbatch.devstack import DevStack, DevStackError

    try:
        status = DevStack(Settings()).up()
    except DevStackError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(status.model_dump_json(indent=2) if as_json else status.describe())


@app.command("down")
def down() -> None:
    """Stop every part of the embedded stack (data stays in the state folder)."""
    from llmbatch.devstack import DevStack

    DevStack(Settings()).down()
    typer.echo("llm-batch dev stack stopped")


@app.command("status")
def status(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Say which parts run, and where."""
    from llmbatch.devstack import DevStack

    state = DevStack(Settings()).status()
    if as_json:
        typer.echo(json.dumps(state.model_dump(), indent=2))
    else:
        typer.echo(state.describe())
    if not state.running:
        raise typer.Exit(3)


@app.command("tiny-model")
def tiny_model(
    path: Annotated[Path, typer.Argument(help="Folder to write the model to.")],
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Build the tiny offline test model (random weights: its answers are random)."""
    from llmbatch.tiny_model import build_tiny_model

    typer.echo(str(build_tiny_model(path, seed=seed)))
