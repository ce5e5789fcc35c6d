"""The object store interface on the real S3 server and on the local disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmbatch import storage
from llmbatch.config import Settings


def test_s3_listing_ranges_and_deletes(stack: Settings, bucket: str) -> None:
    store = storage.open_store(f"s3://{bucket}", stack)
    for key in ("in/a.jsonl", "in/b.jsonl", "in/c.csv", "other/d.jsonl"):
        store.put_bytes(f"s3://{bucket}/{key}", b"0123456789")

    globbed = store.list(f"s3://{bucket}/in/*.jsonl")
    assert [o.uri for o in globbed] == [f"s3://{bucket}/in/a.jsonl", f"s3://{bucket}/in/b.jsonl"]
    assert len(store.list(f"s3://{bucket}/in/")) == 3
    assert len(store.list(f"s3://{bucket}/in")) == 3  # a folder without the slash
    assert store.read_range(f"s3://{bucket}/in/a.jsonl", 2, 5) == b"234"
    assert store.open_read(f"s3://{bucket}/in/c.csv").read() == b"0123456789"
    assert store.delete_prefix(f"s3://{bucket}/in/") == 3
    assert not store.exists(f"s3://{bucket}/in/a.jsonl")


def test_s3_missing_input_names_the_uri(stack: Settings, bucket: str) -> None:
    store = storage.open_store(f"s3://{bucket}", stack)
    with pytest.raises(storage.InputNotFound, match=f"s3://{bucket}/nothing/"):
        store.list(f"s3://{bucket}/nothing/*.csv")
    with pytest.raises(storage.InputNotFound):
        store.read_bytes(f"s3://{bucket}/absent.jsonl")


def test_local_paths_globs_and_file_uris(tmp_path: Path) -> None:
    store = storage.LocalStore()
    (tmp_path / "d").mkdir()
    for name in ("a.jsonl", "b.jsonl", "c.csv"):
        (tmp_path / "d" / name).write_bytes(b"abc")
    assert [o.uri for o in store.list(str(tmp_path / "d" / "*.jsonl"))] == [
        str(tmp_path / "d" / "a.jsonl"),
        str(tmp_path / "d" / "b.jsonl"),
    ]
    listed = store.list(f"file://{tmp_path / 'd'}")
    assert listed[0].uri == f"file://{tmp_path / 'd' / 'a.jsonl'}"
    with pytest.raises(storage.InputNotFound):
        store.list(str(tmp_path / "nope.csv"))


def test_local_writes_replace_atomically(tmp_path: Path) -> None:
    store = storage.LocalStore()
    target = f"file://{tmp_path}/out/part-00000.jsonl"
    store.put_bytes(target, b"first")
    store.put_bytes(target, b"second")
    assert store.read_bytes(target) == b"second"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-00000.jsonl"]


def test_unknown_scheme_is_refused(stack: Settings) -> None:
    with pytest.raises(storage.StorageError, match="unsupported URI scheme 'gs'"):
        storage.open_store("gs://b/k", stack)
