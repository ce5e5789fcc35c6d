"""A model folder built once: by a recipe, cached by the recipe's content hash.

Every local model llm-batch builds (the tiny random-weight models, the converted real
one) is written by a builder function from a *recipe*: a JSON-able mapping of all that
decides the folder's bytes (sizes, seed, tokens, template, source file hash, a format
version for what the code itself changes). :func:`build_once` writes the folder beside
its target, puts a marker holding the recipe and its SHA-256 in last, and renames it
into place, so a folder appears complete or not at all. A folder whose marker names
the same hash is reused as it is; one with another hash (an older recipe, another
seed) or none (a build that crashed) is replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MARKER = "llm-batch-model.json"


def recipe_hash(recipe: Mapping[str, Any]) -> str:
    """The SHA-256 of the recipe's canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def built_recipe(path: Path) -> dict[str, Any] | None:
    """The recipe the folder at ``path`` was built from, or None if it was never
    finished (or is no such folder)."""
    with contextlib.suppress(OSError, ValueError):
        marker = json.loads((Path(path) / MARKER).read_text())
        if isinstance(marker, dict) and isinstance(marker.get("recipe"), dict):
            return marker["recipe"]
    return None


def is_built(path: Path, recipe: Mapping[str, Any]) -> bool:
    """True when ``path`` holds a finished folder of this very recipe."""
    with contextlib.suppress(OSError, ValueError):
        marker = json.loads((Path(path) / MARKER).read_text())
        return isinstance(marker, dict) and marker.get("sha256") == recipe_hash(recipe)
    return False


def build_once(path: Path, recipe: Mapping[str, Any], write: Callable[[Path], None]) -> Path:
    """Have ``write(folder)`` build the model of ``recipe`` into ``path`` unless it is
    there already; return ``path``.

    ``write`` gets an empty staging folder beside ``path`` (same file system, so the
    rename is atomic) and fills it; the marker is added after it returns.
    """
    path = Path(path)
    if is_built(path, recipe):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model folder is not a secret
    try:
        write(staging)
        # The marker goes last: a folder without it was never finished.
        marker = {"sha256": recipe_hash(recipe), "recipe": dict(recipe)}
        (staging / MARKER).write_text(json.dumps(marker, sort_keys=True, indent=1) + "\n")
        if path.exists():
            shutil.rmtree(path)
        try:
            staging.rename(path)
        except OSError:
            # Another process built it at the same moment; theirs is as good as ours.
            if not is_built(path, recipe):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
