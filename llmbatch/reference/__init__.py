"""The reference pages under ``docs/reference/``, generated from the code that declares
what they describe: the Typer app (commands and options), the settings model, the job
spec's JSON Schema, the error-class and failure-type enums with their explanations, and
the telemetry instruments.

It owns only rendering: each module turns one declaration into Markdown, and
:func:`render_all` names the files. It may import anything in ``llmbatch`` (it reads,
never runs, the code it describes) but the CLI: ``llm-batch docs`` hands it the root
command to describe, so the CLI imports this package and never the other way round.
Nothing else imports it.
The output is deterministic (stable order, no timestamps, no machine paths), so a test
can regenerate it and fail when the committed pages are stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmbatch.reference import cli, errors, index, metrics, settings, spec

if TYPE_CHECKING:
    from typer.core import TyperGroup

#: The files under docs/reference/, in the order :func:`render_all` gives them.
PAGES = ("index.md", "cli.md", "settings.md", "job-spec.md", "errors.md", "metrics.md")


def render_all(command: TyperGroup) -> dict[str, str]:
    """Every reference page's file name and text; ``command`` is the CLI's root command
    (``llm-batch`` itself), whose commands and options the CLI page lists."""
    return {
        "index.md": index.render(),
        "cli.md": cli.render(command),
        "settings.md": settings.render(),
        "job-spec.md": spec.render(),
        "errors.md": errors.render(),
        "metrics.md": metrics.render(),
    }


def write(out_dir: Path, *, command: TyperGroup) -> list[str]:
    """Write every page under ``out_dir``; the names of those whose text changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in render_all(command).items():
        path = out_dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(name)
    return changed


def stale(out_dir: Path, *, command: TyperGroup) -> list[str]:
    """The pages under ``out_dir`` that are missing or differ from what the code gives."""
    return [
        name
        for name, text in render_all(command).items()
        if not (out_dir / name).is_file() or (out_dir / name).read_text(encoding="utf-8") != text
    ]
