"""``llm-batch docs generate``: write the reference pages, or check they are current."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from llmbatch.cli._support.common import fail

app = typer.Typer(
    name="docs", help="The docs site's generated reference pages.", no_args_is_help=True
)

DEFAULT_OUT = Path("docs/reference")


@app.command("generate")
def generate(
    ctx: typer.Context,
    out: Annotated[
        Path, typer.Option(help="Folder of the reference pages (docs/reference in the repo).")
    ] = DEFAULT_OUT,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Write nothing; exit 1 when a page is missing or out of date."
        ),
    ] = False,
) -> None:
    """Generate the reference pages (CLI, settings, job spec, errors, metrics) from the code."""
    from llmbatch import reference

    # The tree this command is part of: the reference describes it, and needs to
    # import no command module to get it.
    command = ctx.find_root().command
    assert isinstance(command, TyperGroup), "llm-batch is an app of many commands"
    if check:
        stale = reference.stale(out, command=command)
        if stale:
            raise fail(f"out of date in {out}: {', '.join(stale)}; run `llm-batch docs generate`")
        typer.echo(f"{out} is up to date")
        return
    changed = reference.write(out, command=command)
    typer.echo(f"wrote {', '.join(changed)}" if changed else f"{out} is up to date")
