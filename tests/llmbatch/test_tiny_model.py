from __future__ import annotations

from pathlib import Path

import pytest

from llmbatch.tiny_model import build_tiny_model


@pytest.mark.slow
def test_build_is_deterministic_and_idempotent(tmp_path: Path, tiny_model_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_path / name).read_bytes(), name
    size = sum(p.stat().st_size for p in again.iterdir())
    assert size < 4 << 20
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(again)  # already there: nothing is rebuilt
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
