"""Plain numbered SQL migrations (``migrations/NNNN_name.sql``), applied in order.

Each file runs in its own transaction and is recorded in ``schema_migrations``
with its sha256; running twice is a no-op, and an applied file whose content
changed is refused. A session advisory lock keeps two processes that start at
once from racing: the second waits, then finds nothing left to do.

The files ship inside the installed package (the ``llmbatch.migrations`` package's
data) and are read through :mod:`importlib.resources`, so a wheel installed anywhere
finds them without the source tree; a folder of one's own may be given instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import itertools
import re
from dataclasses import dataclass
from importlib.resources.abc import Traversable

import asyncpg

from llmbatch.errors import LlmBatchError

_NAME = re.compile(r"^(\d{4})_[A-Za-z0-9_]+\.sql$")
_FIRST = "0001_initial.sql"
# Any constant shared by every llm-batch process; it names the lock, nothing else.
_LOCK_KEY = 0x6C6D6261746368

_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


class MigrationError(LlmBatchError):
    """The migrations folder and the database disagree, or a migration failed."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file: its number, file name, SQL and the SQL's sha256."""

    version: int
    name: str
    sql: str
    checksum: str


def packaged_migrations() -> Traversable:
    """The migrations shipped with llm-batch: a source checkout's ``migrations/`` folder,
    or the copy inside an installed wheel."""
    try:
        found = importlib.resources.files("llmbatch.migrations")
    except ImportError as exc:
        # E.g. an editable install made before migrations/ became a package.
        raise MigrationError(
            f"llm-batch's migrations are not installed ({exc}); reinstall llm-batch"
        ) from None
    # A checkout whose editable install predates the SQL files would hold none;
    # applying "nothing" from it would pass for an up-to-date schema.
    if not (found / _FIRST).is_file():
        raise MigrationError(
            f"the 'llmbatch.migrations' package at {found} holds no {_FIRST}; reinstall llm-batch"
        )
    return found


def load_migrations(directory: Traversable | None = None) -> list[Migration]:
    """The ``*.sql`` files in ``directory`` (default: :func:`packaged_migrations`),
    checked to be numbered 0001, 0002, … exactly.

    A :class:`~pathlib.Path` is a ``Traversable`` too, so a plain folder works as well.
    """
    if directory is None:
        directory = packaged_migrations()
    if not directory.is_dir():
        raise MigrationError(f"migrations folder {directory} does not exist")
    found: list[Migration] = []
    files = (p for p in directory.iterdir() if p.name.endswith(".sql") and p.is_file())
    for path in sorted(files, key=lambda p: p.name):
        match = _NAME.match(path.name)
        if match is None:
            raise MigrationError(
                f"{path.name}: migration files are named NNNN_name.sql (e.g. 0002_add_index.sql)"
            )
        try:
            # Universal newlines: a checkout with CRLF line ends is not a changed file.
            sql = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise MigrationError(f"{path.name} is not UTF-8 text: {exc}") from None
        except OSError as exc:
            raise MigrationError(f"cannot read {path}: {exc}") from None
        checksum = hashlib.sha256(sql.encode("utf-8")).hexdigest()
        found.append(Migration(int(match.group(1)), path.name, sql, checksum))
    for before, after in itertools.pairwise(found):
        if before.version == after.version:
            raise MigrationError(
                f"{before.name} and {after.name} share the number {after.version:04d}; "
                "give each migration its own number"
            )
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise MigrationError(
                f"{migration.name}: expected migration number {expected:04d} "
                "(numbers start at 0001 and have no gaps)"
            )
    return found


async def apply_migrations(dsn: str, directory: Traversable | None = None) -> list[str]:
    """Apply the migrations in ``directory`` (default: the shipped ones) not applied yet;
    return the file names applied now.

    Raises :class:`MigrationError` when the files are misnamed, numbered with a gap
    or a repeat, differ from what was applied, or when a migration fails (it is
    rolled back; those before it stay applied). Connection errors pass through.
    """
    if directory is None:
        directory = packaged_migrations()
    migrations = load_migrations(directory)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        try:
            return await _apply_locked(conn, migrations, directory)
        finally:
            # Closing the connection releases the lock too; this only makes it prompt,
            # and must not hide the error that got us here.
            with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    finally:
        await conn.close()


async def _apply_locked(
    conn: asyncpg.Connection, migrations: list[Migration], directory: Traversable
) -> list[str]:
    await conn.execute(_BOOKKEEPING)
    applied = {
        r["version"]: (r["name"], r["checksum"])
        for r in await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
    }
    for version, (name, _) in sorted(applied.items()):
        if version > len(migrations):
            raise MigrationError(
                f"the database has migration {name}, which is not in {directory}; "
                "is this an older checkout?"
            )
    done: list[str] = []
    for migration in migrations:
        if migration.version in applied:
            _, checksum = applied[migration.version]
            if checksum != migration.checksum:
                raise MigrationError(
                    f"{migration.name} changed after it was applied; add a new "
                    "migration instead of editing an applied one"
                )
            continue
        try:
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    migration.version,
                    migration.name,
                    migration.checksum,
                )
        except asyncpg.PostgresError as exc:
            message = " ".join(str(exc).split())
            raise MigrationError(
                f"{migration.name} failed and was rolled back: {type(exc).__name__}: {message}"
            ) from exc
        done.append(migration.name)
    return done
