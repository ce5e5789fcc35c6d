"""The reference pages under ``docs/reference/``, generated from the code that declares
what they describe: the Typer app (commands and options), the settings model, the job
spec's JSON Schema, the error-class and failure-type enums with their explanations, and
the telemetry instruments.

It owns only rendering: each module turns one declaration into Markdown, and
:func:`render_all` names the files. It may import anything in ``llmbatch`` (it reads,
never runs, the code it describes) and nothing imports it but ``llm-batch docs``.
The output is deterministic (stable order, no timestamps, no machine paths), so a test
can regenerate it and fail when the committed pages are stale.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmbatch.reference import cli, errors, index, metrics, settings, spec

#: File name under docs/reference/ -> the function that renders it.
PAGES: dict[str, Callable[[], str]] = {
    "index.md": index.render,
    "cli.md": cli.render,
    "settings.md": settings.render,
    "job-spec.md": spec.render,
    "errors.md": errors.render,
    "metrics.md": metrics.render,
}


def render_all() -> dict[str, str]:
    """Every reference page's file name and text."""
    return {name: render() for name, render in PAGES.items()}


def write(out_dir: Path) -> list[str]:
    """Write every page under ``out_dir``; the names of those whose text changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in render_all().items():
        path = out_dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(name)
    return changed


def stale(out_dir: Path) -> list[str]:
    """The pages under ``out_dir`` that are missing or differ from what the code gives."""
    return [
        name
        for name, text in render_all().items()
        if not (out_dir / name).is_file() or (out_dir / name).read_text(encoding="utf-8") != text
    ]
