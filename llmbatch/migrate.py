"""Plain numbered SQL migrations (``migrations/NNNN_name.sql``), applied in order.

Each file runs in its own transaction and is recorded with its sha256; running
twice is a no-op, and an applied file whose content changed is refused. An
advisory lock keeps two processes that start at once from racing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

_NAME = re.compile(r"^(\d{4})_[A-Za-z0-9_]+\.sql$")
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


class MigrationError(Exception):
    """The migrations folder and the database disagree; the message says how."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations(directory: Path) -> list[Migration]:
    """The migration files in ``directory``, checked to be numbered 1, 2, 3, …"""
    if not directory.is_dir():
        raise MigrationError(f"migrations folder {directory} does not exist")
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if match is None:
            raise MigrationError(f"{path.name}: migration files are named NNNN_name.sql")
        found.append(Migration(int(match.group(1)), path.name, path.read_text()))
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise MigrationError(
                f"{migration.name}: expected migration number {expected:04d} "
                "(numbers start at 0001 and have no gaps or repeats)"
            )
    return found


async def apply_migrations(dsn: str, directory: Path) -> list[str]:
    """Apply what is not applied yet; return the names applied now."""
    migrations = load_migrations(directory)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        try:
            await conn.execute(_BOOKKEEPING)
            applied = {
                r["version"]: (r["name"], r["checksum"])
                for r in await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
            }
            for version, (name, _) in applied.items():
                if version > len(migrations):
                    raise MigrationError(
                        f"the database has migration {name}, which is not in {directory}"
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
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name, checksum) "
                        "VALUES ($1, $2, $3)",
                        migration.version,
                        migration.name,
                        migration.checksum,
                    )
                done.append(migration.name)
            return done
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    finally:
        await conn.close()
