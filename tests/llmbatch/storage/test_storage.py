"""The object store interface on the real S3 server (SeaweedFS) and on the local disk."""

from __future__ import annotations

import io
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import BotoCoreError, ClientError, IncompleteReadError
from pydantic import SecretStr

from llmbatch import storage
from llmbatch.config import Settings
from llmbatch.contract.uris import scheme_of, split_scheme
from llmbatch.devstack.process import free_port
from llmbatch.storage.base import InputNotFound, StorageError
from llmbatch.storage.local import LocalStore
from llmbatch.storage.s3 import S3Store

# --- S3 -----------------------------------------------------------------------------


@pytest.fixture
def s3(storage_settings: Settings) -> storage.base.ObjectStore:
    return storage.stores.open_store("s3://any", storage_settings)


def put_keys(store: storage.base.ObjectStore, bucket: str, *keys: str) -> None:
    for key in keys:
        store.put_bytes(f"s3://{bucket}/{key}", key.encode())


def uris(infos: list[storage.base.ObjectInfo]) -> list[str]:
    return [o.uri for o in infos]


def test_open_store_dispatches_by_scheme(storage_settings: Settings) -> None:
    assert isinstance(storage.stores.open_store("s3://b/k", storage_settings), S3Store)
    assert isinstance(storage.stores.open_store("S3://b/k", storage_settings), S3Store)
    for uri in ("file:///tmp/x", "/tmp/x", "rel/x.csv", "x.csv"):
        assert isinstance(storage.stores.open_store(uri, storage_settings), LocalStore)
    with pytest.raises(StorageError, match="unsupported URI scheme 'gs'"):
        storage.stores.open_store("gs://b/k", storage_settings)


def test_s3_globs_stay_within_a_folder_unless_double_star(
    s3: storage.base.ObjectStore, bucket: str
) -> None:
    put_keys(s3, bucket, "in/b.jsonl", "in/a.jsonl", "in/c.csv", "in/sub/d.jsonl", "x.jsonl")
    base = f"s3://{bucket}"
    assert uris(s3.list(f"{base}/in/*.jsonl")) == [f"{base}/in/a.jsonl", f"{base}/in/b.jsonl"]
    assert uris(s3.list(f"{base}/in/**/*.jsonl")) == [
        f"{base}/in/a.jsonl",
        f"{base}/in/b.jsonl",
        f"{base}/in/sub/d.jsonl",
    ]
    assert uris(s3.list(f"{base}/in/[ab].*")) == [f"{base}/in/a.jsonl", f"{base}/in/b.jsonl"]
    assert uris(s3.list(f"{base}/in/?.csv")) == [f"{base}/in/c.csv"]
    assert uris(s3.list(f"{base}/*.jsonl")) == [f"{base}/x.jsonl"]
    assert s3.list(f"{base}/in/a.jsonl") == [storage.base.ObjectInfo(f"{base}/in/a.jsonl", 10)]


def test_s3_folders_list_everything_below_except_hidden(
    s3: storage.base.ObjectStore, bucket: str
) -> None:
    put_keys(
        s3, bucket,
        "in/a.jsonl", "in/sub/b.jsonl", "in/_SUCCESS", "in/.tmp/x", "in/_staging/y", "inside.csv",
    )  # fmt: skip
    base = f"s3://{bucket}"
    expected = [f"{base}/in/a.jsonl", f"{base}/in/sub/b.jsonl"]
    assert uris(s3.list(f"{base}/in/")) == expected
    assert uris(s3.list(f"{base}/in")) == expected  # a folder named without its slash
    assert [o.size for o in s3.list(f"{base}/in/")] == [len("in/a.jsonl"), len("in/sub/b.jsonl")]
    assert len(s3.list(base)) == 3  # the whole bucket
    # Hidden files are only skipped under a folder: asked for by name, they are there.
    assert uris(s3.list(f"{base}/in/_SUCCESS")) == [f"{base}/in/_SUCCESS"]


def test_s3_nothing_found_names_the_uri(s3: storage.base.ObjectStore, bucket: str) -> None:
    put_keys(s3, bucket, "in/a.jsonl")
    for uri in (f"s3://{bucket}/in/*.csv", f"s3://{bucket}/nothing/", f"s3://{bucket}/in/a"):
        with pytest.raises(InputNotFound, match=uri.replace("*", r"\*")):
            s3.list(uri)
    with pytest.raises(storage.base.BucketNotFound, match="there is no bucket 'no-such-bucket-x'"):
        s3.list("s3://no-such-bucket-x/data/")
    with pytest.raises(storage.base.BucketNotFound):
        s3.list("s3://no-such-bucket-x/data/*.csv")
    missing = f"s3://{bucket}/absent.jsonl"
    for call in (s3.size, s3.read_bytes, s3.open_read):
        with pytest.raises(InputNotFound, match=missing):
            call(missing)
    with pytest.raises(InputNotFound):
        s3.read_range(missing, 0, 10)
    assert not s3.exists(missing)


def test_s3_bad_uris_are_permanent_errors(s3: storage.base.ObjectStore, bucket: str) -> None:
    with pytest.raises(StorageError, match="names a bucket, not an object"):
        s3.put_bytes(f"s3://{bucket}", b"x")
    with pytest.raises(StorageError, match="not an s3://bucket/key URI"):
        s3.size("s3:///key")


def test_s3_wrong_credentials_are_permanent(
    storage_settings: Settings, bucket: str, tmp_path: Path
) -> None:
    wrong = storage_settings.model_copy(update={"s3_secret_access_key": SecretStr("wrong")})
    store = S3Store(wrong)
    source = tmp_path / "f.txt"
    source.write_bytes(b"x")
    calls = [
        lambda: store.list(f"s3://{bucket}/in/"),
        lambda: store.read_bytes(f"s3://{bucket}/k"),
        lambda: store.put_bytes(f"s3://{bucket}/k", b"x"),
        lambda: store.put_file(f"s3://{bucket}/k", source),
    ]
    for call in calls:
        with pytest.raises(StorageError) as info:
            call()
        assert not isinstance(info.value, InputNotFound)
        assert "SignatureDoesNotMatch" in str(info.value) or "AccessDenied" in str(info.value)


def test_s3_transient_errors_propagate_unchanged(storage_settings: Settings) -> None:
    # Nothing listens on this port: a connection error is not a StorageError, so the
    # activity fails retryably and Temporal tries again.
    dead = storage_settings.model_copy(
        update={"s3_endpoint_url": f"http://127.0.0.1:{free_port()}"}
    )
    store = S3Store(dead, client=storage.s3.s3_client(dead, max_attempts=1))
    with pytest.raises(BotoCoreError) as info:
        store.read_bytes("s3://b/k")
    assert not isinstance(info.value, StorageError)


def test_s3_ranges_and_streaming_reads(s3: storage.base.ObjectStore, bucket: str) -> None:
    uri = f"s3://{bucket}/r.bin"
    data = bytes(range(256)) * 40  # 10,240 bytes
    s3.put_bytes(uri, data)
    assert s3.size(uri) == len(data)
    assert s3.read_range(uri, 2, 5) == data[2:5]
    assert s3.read_range(uri, 10_000, 20_000) == data[10_000:]  # cut at the end
    assert s3.read_range(uri, 20_000, 20_010) == b""  # past the end
    assert s3.read_range(uri, 5, 5) == b""
    with s3.open_read(uri) as reader:
        assert reader.read(100) == data[:100]
        assert reader.read() == data[100:]
    with s3.open_read(uri, start=1000, end=3000) as reader:
        parts = iter(lambda: reader.read(333), b"")
        assert b"".join(parts) == data[1000:3000]
    with s3.open_read(uri, start=20_000) as reader:
        assert reader.read() == b""


def drop_connection(reader: object) -> None:
    """Fault injector: close the HTTP response under a streaming S3 reader, as a
    dropped connection would; the next read of the body then comes up short."""
    raw = reader.raw  # type: ignore[attr-defined]
    raw._body.close()


def test_s3_streaming_read_resumes_after_a_dropped_connection(
    s3: storage.base.ObjectStore, bucket: str
) -> None:
    uri = f"s3://{bucket}/big.bin"
    data = os.urandom(3 << 20)
    s3.put_bytes(uri, data)
    with s3.open_read(uri, start=100, end=(3 << 20) - 100) as reader:
        first = reader.read(1 << 20)
        drop_connection(reader)
        rest = reader.read()
        assert reader.raw._resumes == 1  # type: ignore[attr-defined]
    assert first + rest == data[100:-100]


class _DroppingClient:
    """A stand-in S3 client whose first GET body breaks off after ``keep`` bytes, as
    a dropped connection does (no real server can be told to do that on demand)."""

    def __init__(self, data: bytes, keep: int) -> None:
        self.data, self.keep = data, keep
        self.ranges: list[str] = []

    def get_object(self, Bucket: str, Key: str, Range: str, **_: Any) -> dict[str, Any]:
        self.ranges.append(Range)
        first, last = (int(n) for n in Range.removeprefix("bytes=").split("-"))
        body = io.BytesIO(self.data[first : last + 1])
        if len(self.ranges) == 1:
            body = _BreaksOff(body, self.keep)
        return {"ETag": '"e1"', "Body": body}


class _BreaksOff(io.BytesIO):
    def __init__(self, inner: io.BytesIO, keep: int) -> None:
        super().__init__(inner.read(keep))

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if not data:
            raise IncompleteReadError(actual_bytes=0, expected_bytes=size or 0)
        return data


def test_s3_read_range_resumes_after_a_dropped_connection() -> None:
    data = bytes(range(256)) * 8
    client = _DroppingClient(data, keep=100)
    store = S3Store(Settings(), client=client)  # type: ignore[arg-type]
    assert store.read_range("s3://b/k", 10, 1010) == data[10:1010]
    assert client.ranges == ["bytes=10-1009", "bytes=110-1009"]


def test_s3_streaming_read_refuses_an_object_replaced_midway(
    s3: storage.base.ObjectStore, bucket: str
) -> None:
    uri = f"s3://{bucket}/big.bin"
    s3.put_bytes(uri, os.urandom(3 << 20))
    with s3.open_read(uri) as reader:
        reader.read(1 << 20)
        s3.put_bytes(uri, os.urandom(3 << 20))
        drop_connection(reader)
        with pytest.raises(StorageError, match="changed while it was being read"):
            reader.read()


def test_s3_put_file_multipart_and_replace(
    s3: storage.base.ObjectStore, bucket: str, tmp_path: Path
) -> None:
    source = tmp_path / "big.bin"
    data = os.urandom(9 << 20)  # over boto3's 8 MiB multipart threshold
    source.write_bytes(data)
    uri = f"s3://{bucket}/up/big.bin"
    s3.put_file(uri, source)
    assert s3.size(uri) == len(data)
    assert s3.read_bytes(uri) == data
    s3.put_bytes(uri, b"small")
    assert s3.read_bytes(uri) == b"small"


def test_s3_delete_prefix_deletes_a_folder_and_nothing_beside_it(
    s3: storage.base.ObjectStore, bucket: str
) -> None:
    put_keys(s3, bucket, "out/a", "out/sub/b", "output/c", "out")
    base = f"s3://{bucket}"
    assert s3.delete_prefix(f"{base}/out") == 3  # the object "out" and all under "out/"
    assert uris(s3.list(base)) == [f"{base}/output/c"]
    assert s3.delete_prefix(f"{base}/out/") == 0
    put_keys(s3, bucket, *(f"many/{i:04d}" for i in range(1005)))  # over one request's 1000
    assert s3.delete_prefix(f"{base}/many/") == 1005
    assert not s3.exists(f"{base}/many/0000")
    with pytest.raises(StorageError, match="refusing to delete everything"):
        s3.delete_prefix(f"{base}/")


def test_s3_delete_removes_one_object_and_a_missing_one_is_no_error(
    s3: storage.base.ObjectStore, bucket: str
) -> None:
    put_keys(s3, bucket, "out", "out/a", "outer")
    base = f"s3://{bucket}"
    s3.delete(f"{base}/out")
    assert uris(s3.list(base)) == [f"{base}/out/a", f"{base}/outer"]
    s3.delete(f"{base}/out")  # gone already: S3 answers the same
    s3.delete(f"{base}/never-was")
    with pytest.raises(storage.base.BucketNotFound):
        s3.delete(f"s3://{bucket}-missing/out")


# --- local disk ---------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in ("d/b.jsonl", "d/a.jsonl", "d/c.csv", "d/sub/e.jsonl", "d/_SUCCESS", "d/.x.tmp"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
    return tmp_path


def test_local_globs_folders_and_file_uris(tree: Path) -> None:
    store = LocalStore([tree])
    d = tree / "d"
    assert uris(store.list(str(d / "*.jsonl"))) == [str(d / "a.jsonl"), str(d / "b.jsonl")]
    assert uris(store.list(str(d / "**" / "*.jsonl"))) == [
        str(d / "a.jsonl"),
        str(d / "b.jsonl"),
        str(d / "sub" / "e.jsonl"),
    ]
    folder = [str(d / n) for n in ("a.jsonl", "b.jsonl", "c.csv", "sub/e.jsonl")]
    assert uris(store.list(str(d))) == folder
    assert uris(store.list(f"{d}/")) == folder
    assert uris(store.list(f"file://{d}")) == [f"file://{p}" for p in folder]
    assert uris(store.list(f"file://{d}/*.csv")) == [f"file://{d}/c.csv"]
    assert uris(store.list(f"file://localhost{d}/c.csv")) == [f"file://{d}/c.csv"]
    assert store.list(str(d / "c.csv")) == [
        storage.base.ObjectInfo(str(d / "c.csv"), len("d/c.csv"))
    ]


def test_local_relative_paths_stay_relative(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree)
    store = LocalStore([tree])
    assert uris(store.list("d/*.csv")) == ["d/c.csv"]
    assert store.read_bytes("d/c.csv") == b"d/c.csv"


def test_local_missing_and_bad_inputs(tree: Path) -> None:
    store = LocalStore([tree])
    with pytest.raises(InputNotFound, match=re.escape(f"{tree}/nope.csv does not exist")):
        store.list(str(tree / "nope.csv"))
    with pytest.raises(InputNotFound, match=r"no files match .*\*\.parquet"):
        store.list(str(tree / "d" / "*.parquet"))
    with pytest.raises(InputNotFound):
        store.read_bytes(str(tree / "nope.csv"))
    with pytest.raises(StorageError, match="is a directory"):
        store.size(str(tree / "d"))
    with pytest.raises(StorageError, match="file URIs name no host"):
        store.list("file://somehost/data.csv")
    assert not store.exists(str(tree / "d"))
    assert store.exists(f"file://{tree}/d/c.csv")


def test_local_ranges_and_streaming_reads(tmp_path: Path) -> None:
    store = LocalStore([tmp_path])
    data = bytes(range(256)) * 40
    uri = f"file://{tmp_path}/r.bin"
    store.put_bytes(uri, data)
    assert store.size(uri) == len(data)
    assert store.read_range(uri, 2, 5) == data[2:5]
    assert store.read_range(uri, 10_000, 20_000) == data[10_000:]
    assert store.read_range(uri, 20_000, 20_010) == b""
    with store.open_read(uri, start=1000, end=3000) as reader:
        assert b"".join(iter(lambda: reader.read(333), b"")) == data[1000:3000]
    with store.open_read(uri, start=10_000) as reader:
        assert reader.read() == data[10_000:]


def test_local_writes_replace_atomically(tmp_path: Path) -> None:
    store = LocalStore([tmp_path])
    target = f"file://{tmp_path}/out/part-00000.jsonl"
    store.put_bytes(target, b"first")
    store.put_bytes(target, b"second")
    assert store.read_bytes(target) == b"second"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-00000.jsonl"]
    mode = stat.S_IMODE((tmp_path / "out" / "part-00000.jsonl").stat().st_mode)
    assert mode & 0o044 == 0o044  # readable like any written file, not mkstemp's 0600

    # A write that fails midway leaves the old object whole and no temporary file.
    with pytest.raises(StorageError, match="is a directory"):
        store.put_file(target, tmp_path / "out")
    assert store.read_bytes(target) == b"second"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-00000.jsonl"]

    source = tmp_path / "src.bin"
    source.write_bytes(b"from a file")
    store.put_file(target, source)
    assert store.read_bytes(target) == b"from a file"


def test_local_delete_prefix(tree: Path) -> None:
    store = LocalStore([tree])
    (tree / "dd").mkdir()
    (tree / "dd" / "keep").write_bytes(b"x")
    assert store.delete_prefix(str(tree / "d")) == 6  # hidden files go too
    assert not (tree / "d").exists()
    assert (tree / "dd" / "keep").exists()
    assert store.delete_prefix(str(tree / "d")) == 0
    assert store.delete_prefix(f"file://{tree}/dd/keep") == 1


def test_local_delete_removes_one_file_and_leaves_folders(tree: Path) -> None:
    store = LocalStore([tree])
    (tree / "one").write_bytes(b"x")
    store.delete(str(tree / "one"))
    assert not (tree / "one").exists()
    store.delete(str(tree / "one"))  # gone already
    store.delete(str(tree / "d"))  # a folder is no object: it stays
    assert (tree / "d").is_dir()


def test_local_store_reads_nothing_outside_its_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.csv").write_text("a\n1\n")
    secret = tmp_path / "secret.csv"
    secret.write_text("password\nhunter2\n")
    store = LocalStore([root])
    for uri in (
        "/etc/os-release",
        f"file://{secret}",
        f"{root}/../secret.csv",  # ".." climbs out before the root is checked
        f"file://{tmp_path}/*.csv",
        str(tmp_path),
    ):
        with pytest.raises(storage.base.OutsideLocalRoots) as info:
            store.list(uri)
        message = str(info.value)
        # One line naming the path and the setting; nothing of the file.
        assert uri in message and "LLMBATCH_LOCAL_ROOTS" in message
        assert "hunter2" not in message and "\n" not in message
        with pytest.raises(storage.base.OutsideLocalRoots):
            store.read_bytes(uri)
    assert store.read_bytes(str(root / "ok.csv")) == b"a\n1\n"


def test_local_store_refuses_symlinks_that_point_out_of_its_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (root / "in" / "a.csv").write_text("a\n1\n")
    secret = tmp_path / "secret.csv"
    secret.write_text("password\nhunter2\n")
    (root / "in" / "b.csv").symlink_to(secret)
    (root / "outside").symlink_to(tmp_path)
    store = LocalStore([root])
    for uri in (str(root / "in" / "b.csv"), str(root / "in"), f"{root}/in/*.csv"):
        with pytest.raises(storage.base.OutsideLocalRoots, match="LLMBATCH_LOCAL_ROOTS"):
            store.list(uri)
    with pytest.raises(storage.base.OutsideLocalRoots):
        store.open_read(str(root / "in" / "b.csv"))
    # Writing through a symlinked folder would land outside too.
    with pytest.raises(storage.base.OutsideLocalRoots):
        store.put_bytes(str(root / "outside" / "x.csv"), b"x")
    assert not (tmp_path / "x.csv").exists()
    # A symlink that stays inside the roots is followed as before.
    (root / "in" / "c.csv").symlink_to(root / "in" / "a.csv")
    assert store.read_bytes(str(root / "in" / "c.csv")) == b"a\n1\n"


def test_local_store_writes_and_deletes_nothing_outside_its_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "keep").write_bytes(b"k")
    store = LocalStore([root])
    for uri in (f"file://{root}/../../escaped/x.jsonl", str(tmp_path / "x.jsonl")):
        with pytest.raises(storage.base.OutsideLocalRoots):
            store.put_bytes(uri, b"x")
        with pytest.raises(storage.base.OutsideLocalRoots):
            store.check_output(uri)
    with pytest.raises(storage.base.OutsideLocalRoots):
        store.delete_prefix(str(tmp_path / "keep"))
    with pytest.raises(storage.base.OutsideLocalRoots):
        store.exists(str(tmp_path / "keep"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "root"]
    store.check_output(f"file://{root}/out")
    store.put_bytes(f"file://{root}/out/x.jsonl", b"x")
    assert (root / "out" / "x.jsonl").read_bytes() == b"x"


def test_a_root_of_slash_allows_every_path(tmp_path: Path) -> None:
    store = storage.stores.open_store("/etc/os-release", Settings(local_roots=[Path("/")]))
    assert store.read_bytes("/etc/os-release") == Path("/etc/os-release").read_bytes()
    store.put_bytes(str(tmp_path / "x"), b"x")


def test_open_store_takes_the_roots_from_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    monkeypatch.setenv("LLMBATCH_LOCAL_ROOTS", f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    stores = storage.stores.Stores(Settings())
    stores("x").put_bytes(str(tmp_path / "a" / "x"), b"x")
    stores("x").put_bytes(str(tmp_path / "b" / "x"), b"x")
    with pytest.raises(storage.base.OutsideLocalRoots):
        stores("x").put_bytes(str(tmp_path / "c" / "x"), b"x")


def test_s3_check_output_refuses_a_missing_bucket_and_creates_none(
    s3: storage.base.ObjectStore, bucket: str, s3_client: Any
) -> None:
    s3.check_output(f"s3://{bucket}/out")
    missing = f"{bucket}-missing"
    with pytest.raises(storage.base.BucketNotFound, match=f"bucket '{missing}' does not exist"):
        s3.check_output(f"s3://{missing}/out")
    names = [b["Name"] for b in s3_client.list_buckets()["Buckets"]]
    assert bucket in names and missing not in names


# --- URIs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "split", "scheme"),
    [
        ("s3://b/k?x#y", ("s3", "b/k?x#y"), "s3"),  # "?" and "#" stay in the key
        ("S3://b/k", ("S3", "b/k"), "s3"),
        ("file:///tmp/x", ("file", "/tmp/x"), "file"),
        ("/tmp/x", (None, "/tmp/x"), "file"),
        ("rel/x.csv", (None, "rel/x.csv"), "file"),
        ("gs://b/k", ("gs", "b/k"), "gs"),
    ],
)
def test_split_scheme_and_scheme_of(uri: str, split: tuple[str | None, str], scheme: str) -> None:
    assert split_scheme(uri) == split
    assert scheme_of(uri) == scheme


def test_split_s3_and_local_path_refuse_other_schemes() -> None:
    assert storage.s3.split_s3("S3://b/a/k") == ("b", "a/k")
    assert storage.s3.split_s3("s3://b", need_key=False) == ("b", "")
    for uri in ("/b/k", "file:///b/k", "gs://b/k", "s3:///k"):
        with pytest.raises(StorageError, match="not an s3://bucket/key URI"):
            storage.s3.split_s3(uri)
    assert storage.local.local_path("FILE:///tmp/x") == Path("/tmp/x")
    with pytest.raises(StorageError, match="not a file:// URI"):
        storage.local.local_path("s3://b/k")
    with pytest.raises(StorageError, match="name no host"):
        storage.local.local_path("file://host/x")


@pytest.mark.parametrize(
    ("base", "parts", "joined"),
    [
        ("s3://b", ("out", "job-1"), "s3://b/out/job-1"),
        ("s3://b/out/", ("job-1/", "/part-00000.jsonl"), "s3://b/out/job-1/part-00000.jsonl"),
        ("file:///", ("tmp", "x"), "file:///tmp/x"),
        ("file:///data/", ("x",), "file:///data/x"),
        ("/", ("tmp", "x"), "/tmp/x"),
        ("out", ("a/b",), "out/a/b"),
        ("", ("a",), "a"),
        ("s3://b/k", (), "s3://b/k"),
    ],
)
def test_join(base: str, parts: tuple[str, ...], joined: str) -> None:
    assert storage.base.join(base, *parts) == joined


def test_join_refuses_parent_parts() -> None:
    with pytest.raises(StorageError):
        storage.base.join("/data", "../etc")


@pytest.mark.parametrize(
    ("pattern", "matches", "misses"),
    [
        ("in/*.jsonl", ["in/a.jsonl", "in/.jsonl"], ["in/sub/a.jsonl", "in/a.jsonl.gz"]),
        ("in/**/*.csv", ["in/a.csv", "in/x/y/a.csv"], ["other/a.csv"]),
        ("in/**", ["in/a", "in/x/y"], ["inx/a"]),
        ("p-?.pq", ["p-1.pq"], ["p-10.pq"]),
        ("p-[0-2].pq", ["p-1.pq"], ["p-3.pq"]),
        ("p-[!0-2].pq", ["p-3.pq"], ["p-1.pq"]),
        ("a+b(1).csv", ["a+b(1).csv"], ["aab(1).csv"]),
    ],
)
def test_glob_regex(pattern: str, matches: list[str], misses: list[str]) -> None:
    regex = storage.globbing.glob_regex(pattern)
    assert all(regex.match(m) for m in matches)
    assert not any(regex.match(m) for m in misses)


def test_client_errors_map_to_permanent_or_transient() -> None:
    def error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}}, "GetObject")

    assert isinstance(storage.s3.permanent_error(error("NoSuchKey"), "s3://b/k"), InputNotFound)
    assert isinstance(storage.s3.permanent_error(error("AccessDenied"), "s3://b/k"), StorageError)
    for code in ("SlowDown", "InternalError", "503", "RequestTimeout"):
        assert storage.s3.permanent_error(error(code), "s3://b/k").__class__ is ClientError
