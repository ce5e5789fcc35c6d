from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from llmbatch.config import DEFAULT_MIGRATIONS_DIR
from llmbatch.migrate import MigrationError, apply_migrations


@pytest_asyncio.fixture
async def empty_db(pg_dsn: str) -> AsyncIterator[str]:
    """A new, empty database on the session's Postgres."""
    name = f"m_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_dsn)
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        yield pg_dsn.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.close()


def copy_migrations(tmp_path: Path) -> Path:
    target = tmp_path / "migrations"
    shutil.copytree(DEFAULT_MIGRATIONS_DIR, target)
    return target


async def test_applies_in_order_once(empty_db: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0002_extra.sql").write_text("ALTER TABLE jobs ADD COLUMN note text;")

    assert await apply_migrations(empty_db, folder) == ["0001_initial.sql", "0002_extra.sql"]
    assert await apply_migrations(empty_db, folder) == []
    conn = await asyncpg.connect(empty_db)
    rows = await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")
    await conn.close()
    assert [(r["version"], r["name"]) for r in rows] == [
        (1, "0001_initial.sql"),
        (2, "0002_extra.sql"),
    ]


async def test_a_changed_applied_file_is_refused(empty_db: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    await apply_migrations(empty_db, folder)
    path = folder / "0001_initial.sql"
    path.write_text(path.read_text() + "\n-- edited\n")
    with pytest.raises(MigrationError, match=r"0001_initial\.sql changed after it was applied"):
        await apply_migrations(empty_db, folder)


async def test_a_gap_is_refused(empty_db: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0003_late.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="expected migration number 0002"):
        await apply_migrations(empty_db, folder)


async def test_a_failing_migration_leaves_nothing_half_done(empty_db: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0002_bad.sql").write_text("CREATE TABLE half (v int); SELECT * FROM missing;")
    with pytest.raises(asyncpg.PostgresError):
        await apply_migrations(empty_db, folder)
    conn = await asyncpg.connect(empty_db)
    assert await conn.fetchval("SELECT to_regclass('half')") is None
    assert await conn.fetchval("SELECT max(version) FROM schema_migrations") == 1
    await conn.close()
