"""Job commands: submit, status, results, schema."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the job commands to the top-level app."""
