"""A model folder built once per recipe: reused while the recipe's hash matches,
rebuilt when it changes or a build never finished, never left half-written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from llmbatch.devstack.model_cache import MARKER, build_once, built_recipe, recipe_hash


def writer(calls: list[Path], text: str = "weights") -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        calls.append(folder)
        (folder / "model.bin").write_text(text)

    return write


def test_the_hash_is_of_the_content_not_the_key_order() -> None:
    assert recipe_hash({"a": 1, "b": [1, 2]}) == recipe_hash({"b": [1, 2], "a": 1})
    assert recipe_hash({"a": 1}) != recipe_hash({"a": 2})


def test_built_once_per_recipe(tmp_path: Path) -> None:
    calls: list[Path] = []
    path = tmp_path / "m"
    assert build_once(path, {"seed": 0}, writer(calls)) == path
    assert build_once(path, {"seed": 0}, writer(calls)) == path
    assert len(calls) == 1
    assert built_recipe(path) == {"seed": 0}
    # Another recipe replaces the folder.
    build_once(path, {"seed": 1}, writer(calls, "other"))
    assert len(calls) == 2 and (path / "model.bin").read_text() == "other"
    assert sorted(p.name for p in path.iterdir()) == [MARKER, "model.bin"]


def test_a_failed_build_leaves_nothing_and_a_markerless_folder_is_rebuilt(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m"

    def broken(folder: Path) -> None:
        (folder / "half").write_text("x")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(path, {"seed": 0}, broken)
    assert list(tmp_path.iterdir()) == []  # no staging folder left, no target
    path.mkdir()
    (path / "model.bin").write_text("from a crash")
    calls: list[Path] = []
    build_once(path, {"seed": 0}, writer(calls))
    assert len(calls) == 1 and (path / "model.bin").read_text() == "weights"
    assert built_recipe(tmp_path / "nothing") is None
