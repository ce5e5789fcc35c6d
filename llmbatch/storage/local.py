"""The local-disk store: paths and ``file://`` URIs confined to the configured roots
(``LLMBATCH_LOCAL_ROOTS``), writes beside the target renamed over it.
"""

from __future__ import annotations

import glob as globlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from llmbatch.contract.uris import split_scheme

if TYPE_CHECKING:
    pass
from llmbatch.storage.base import (
    READ_BUFFER,
    InputNotFound,
    ObjectInfo,
    OutsideLocalRoots,
    StorageError,
)
from llmbatch.storage.globbing import GLOB_CHARS, has_glob, hidden

# Named in refusals, so an operator knows which setting to widen.
ROOTS_SETTING = "LLMBATCH_LOCAL_ROOTS"


def local_path(uri: str) -> Path:
    """The path of a ``file://`` URI or a plain path."""
    scheme, rest = split_scheme(uri)
    if scheme is not None:
        host, slash, path = rest.partition("/")
        if scheme.lower() != "file":
            raise StorageError(f"not a file:// URI or path: {uri}")
        if host not in ("", "localhost") or not slash:
            raise StorageError(f"file URIs name no host; use file:///abs/path, not {uri}")
        return Path("/" + path)
    return Path(uri).expanduser()


def _listing_base(path: Path) -> Path:
    """The folder a listing of ``path`` reads: ``path`` itself, or for a glob the
    folder above its first wildcard."""
    text = str(path)
    if not has_glob(text):
        return path
    head = text[: min(text.index(c) for c in GLOB_CHARS if c in text)]
    return Path(head.rsplit("/", 1)[0] or "/") if "/" in head else Path(".")


def _os_error(exc: OSError, uri: str) -> Exception:
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return InputNotFound(f"{uri} does not exist")
    if isinstance(exc, PermissionError):
        return StorageError(f"access to {uri} denied: {exc.strerror}")
    if isinstance(exc, IsADirectoryError):
        return StorageError(f"{uri} is a directory, not a file")
    return exc  # EIO and friends: maybe transient


class LocalStore:
    """Files on this machine, under ``roots`` only. Listed URIs keep the form given:
    ``file://`` URIs come back as absolute ``file://`` URIs, plain paths as paths
    (relative stay relative).

    Every path is resolved (``..`` and symlinks) before it is opened, and refused with
    :class:`OutsideLocalRoots` unless it lies under a root: a job spec comes from
    callers this worker need not trust, and must not make it read or write its files.
    """

    def __init__(self, roots: Iterable[Path | str]) -> None:
        self._roots = tuple(Path(r).expanduser().resolve() for r in roots)
        if not self._roots:
            raise ValueError("LocalStore needs at least one root folder ('/' allows all)")

    def _inside(self, path: Path, uri: str) -> Path:
        """``path`` resolved, if it lies under a root; the resolved path is what is
        opened, so a symlink is followed once, here, and not again after the check."""
        resolved = path.resolve(strict=False)
        if not any(resolved.is_relative_to(root) for root in self._roots):
            # The path and the setting, nothing of the file: not even whether it exists.
            raise OutsideLocalRoots(f"{uri} is outside the folders in {ROOTS_SETTING}")
        return resolved

    def _path(self, uri: str) -> Path:
        return self._inside(local_path(uri), uri)

    def list(self, uri: str) -> list[ObjectInfo]:
        path = local_path(uri)
        as_uri = split_scheme(uri)[0] is not None  # local_path allows only file://
        # The folder the listing reads is checked before anything there is looked at.
        self._inside(_listing_base(path), uri)
        if has_glob(str(path)):
            # glob skips dot-files for us, as the S3 side's regex does not need to.
            matches = [Path(p) for p in globlib.glob(str(path), recursive=True)]
        elif path.is_dir():
            matches = [p for p in path.rglob("*") if not hidden(p.relative_to(path).as_posix())]
        elif path.is_file():
            matches = [path]
        elif path.exists():
            raise StorageError(f"{uri} is neither a file nor a directory")
        else:
            raise InputNotFound(f"{uri} does not exist")
        found = []
        for p in matches:
            # A symlink under a root may point anywhere: each file is checked too.
            self._inside(p, str(p))
            try:
                if not p.is_file():
                    continue
                size = p.stat().st_size
            except OSError as exc:
                raise _os_error(exc, str(p)) from exc
            found.append(ObjectInfo(f"file://{p.absolute()}" if as_uri else str(p), size))
        if not found:
            raise InputNotFound(f"no files match {uri}")
        return sorted(found, key=lambda o: o.uri)

    def size(self, uri: str) -> int:
        path = self._path(uri)
        try:
            if path.is_dir():
                raise IsADirectoryError(uri)
            return path.stat().st_size
        except OSError as exc:
            raise _os_error(exc, uri) from exc

    def read_bytes(self, uri: str) -> bytes:
        try:
            return self._path(uri).read_bytes()
        except OSError as exc:
            raise _os_error(exc, uri) from exc

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        with self.open_read(uri, start=start, end=end) as f:
            return f.read()

    def open_read(self, uri: str, *, start: int = 0, end: int | None = None) -> BinaryIO:
        try:
            f = self._path(uri).open("rb")
        except OSError as exc:
            raise _os_error(exc, uri) from exc
        if start:
            f.seek(start)
        if end is None:
            return f
        return io.BufferedReader(_Limited(f, max(end - start, 0)), READ_BUFFER)

    def put_bytes(self, uri: str, data: bytes) -> None:
        with self._atomic(uri) as f:
            f.write(data)

    def put_file(self, uri: str, path: Path) -> None:
        with self._atomic(uri) as f:
            try:
                src = path.open("rb")
            except OSError as exc:
                raise _os_error(exc, str(path)) from exc
            with src:
                shutil.copyfileobj(src, f, READ_BUFFER)

    def _atomic(self, uri: str) -> _AtomicFile:
        return _AtomicFile(self._path(uri), uri)

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()

    def check_output(self, uri: str) -> None:
        self._path(uri)

    def delete(self, uri: str) -> None:
        self._path(uri)
        # As named, not resolved (a symlink is removed, never what it points at); a
        # folder at ``uri`` is no object and stays.
        path = local_path(uri)
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)

    def delete_prefix(self, uri: str) -> int:
        self._path(uri)
        # Deleted as named, not resolved: a symlink is removed, never what it points at.
        path = local_path(uri)
        if path.is_file() or path.is_symlink():
            path.unlink()
            return 1
        if not path.is_dir():
            return 0
        if path.resolve() == Path(path.resolve().anchor):
            raise StorageError(f"refusing to delete everything under {uri}")
        count = sum(1 for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path)
        return count


class _Limited(io.RawIOBase):
    """At most ``remaining`` bytes of a file, from where it stands."""

    # pyarrow's NativeFile.get_stream(offset, nbytes) would do this, but a local
    # read would then be a pyarrow file for this one case and a Python file for all
    # others; a few lines keep them all plain files, whose OSErrors _os_error sorts.

    def __init__(self, f: BinaryIO, remaining: int) -> None:
        self._f = f
        self._remaining = remaining

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = self._f.readinto(view[: min(len(view), self._remaining)])  # type: ignore[attr-defined]
        self._remaining -= n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


class _AtomicFile:
    """A temporary file beside ``path`` that replaces it on a clean exit, else vanishes.

    Its name starts with ``.``, so listings never show it."""

    def __init__(self, path: Path, uri: str) -> None:
        self._path = path
        self._uri = uri
        self._tmp: str | None = None
        self._file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(dir=self._path.parent, prefix=f".{self._path.name}.")
        except OSError as exc:
            raise _os_error(exc, self._uri) from exc
        self._file = os.fdopen(fd, "wb")
        return self._file

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._file is not None and self._tmp is not None
        try:
            if exc_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            if exc_type is None:
                os.chmod(self._tmp, 0o644)  # mkstemp makes it 0600
                os.replace(self._tmp, self._path)
                self._tmp = None
        finally:
            if self._tmp is not None:
                Path(self._tmp).unlink(missing_ok=True)
