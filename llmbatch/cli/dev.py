"""``llm-batch dev up|down|status|tiny-model``."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
