"""Migrations against a fresh, empty database on the session's Postgres."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import asyncpg
import pytest

from llmbatch.devstack.process import free_port
from llmbatch.ledger.migrate import MigrationError, apply_migrations, packaged_migrations
from tests.fixtures.schema import PROJECT_TABLES


def copy_migrations(tmp_path: Path) -> Path:
    """A folder with the project's first migration only: the mechanism's tests add
    their own files after it, whatever the project's later migrations are."""
    target = tmp_path / "migrations"
    target.mkdir()
    first = packaged_migrations() / "0001_initial.sql"
    (target / first.name).write_bytes(first.read_bytes())
    return target


async def applied_versions(dsn: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")
    finally:
        await conn.close()
    return [(r["version"], r["name"]) for r in rows]


async def test_applies_in_order_once(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    # Each needs the one before it, so any other order fails.
    (folder / "0002_note.sql").write_text("ALTER TABLE jobs ADD COLUMN note text;")
    (folder / "0003_note_index.sql").write_text("CREATE INDEX jobs_note ON jobs (note);")

    assert await apply_migrations(empty_db_dsn, folder) == [
        "0001_initial.sql",
        "0002_note.sql",
        "0003_note_index.sql",
    ]
    assert await apply_migrations(empty_db_dsn, folder) == []
    assert await applied_versions(empty_db_dsn) == [
        (1, "0001_initial.sql"),
        (2, "0002_note.sql"),
        (3, "0003_note_index.sql"),
    ]


async def test_only_new_files_are_applied(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    assert await apply_migrations(empty_db_dsn, folder) == ["0001_initial.sql"]
    (folder / "0002_note.sql").write_text("ALTER TABLE jobs ADD COLUMN note text;")
    assert await apply_migrations(empty_db_dsn, folder) == ["0002_note.sql"]


async def test_the_project_schema(empty_db_dsn: str) -> None:
    files = sorted(p.name for p in packaged_migrations().iterdir() if p.name.endswith(".sql"))
    assert files[0] == "0001_initial.sql"
    assert await apply_migrations(empty_db_dsn) == files
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO items (job_id, item_id, shard, ordinal, status) "
                "VALUES ($1, $2, $3, $4, $5)",
                "j",
                "i",
                0,
                0,
                "lost",
            )
    finally:
        await conn.close()
    assert [t["tablename"] for t in tables] == PROJECT_TABLES


async def test_a_changed_applied_file_is_refused(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    await apply_migrations(empty_db_dsn, folder)
    path = folder / "0001_initial.sql"
    path.write_text(path.read_text() + "\n-- edited\n")
    with pytest.raises(MigrationError, match=r"0001_initial\.sql changed after it was applied"):
        await apply_migrations(empty_db_dsn, folder)


async def test_a_gap_is_refused_before_anything_runs(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0003_late.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=r"0003_late\.sql: expected migration number 0002"):
        await apply_migrations(empty_db_dsn, folder)
    conn = await asyncpg.connect(empty_db_dsn)
    assert await conn.fetchval("SELECT to_regclass('jobs')") is None
    await conn.close()


async def test_a_repeated_number_is_refused(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0002_a.sql").write_text("SELECT 1;")
    (folder / "0002_b.sql").write_text("SELECT 2;")
    with pytest.raises(MigrationError, match=r"0002_a\.sql and 0002_b\.sql share the number"):
        await apply_migrations(empty_db_dsn, folder)


async def test_a_misnamed_file_is_refused(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "2_extra.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=r"2_extra\.sql: migration files are named"):
        await apply_migrations(empty_db_dsn, folder)


async def test_a_database_ahead_of_the_folder_is_refused(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0002_note.sql").write_text("ALTER TABLE jobs ADD COLUMN note text;")
    await apply_migrations(empty_db_dsn, folder)
    (folder / "0002_note.sql").unlink()
    with pytest.raises(MigrationError, match=r"has migration 0002_note\.sql, which is not in"):
        await apply_migrations(empty_db_dsn, folder)


async def test_a_failing_migration_leaves_nothing_half_done(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0002_bad.sql").write_text("CREATE TABLE half (v int); SELECT * FROM missing;")
    with pytest.raises(MigrationError, match=r"0002_bad\.sql failed and was rolled back"):
        await apply_migrations(empty_db_dsn, folder)
    conn = await asyncpg.connect(empty_db_dsn)
    assert await conn.fetchval("SELECT to_regclass('half')") is None
    await conn.close()
    assert await applied_versions(empty_db_dsn) == [(1, "0001_initial.sql")]


async def test_two_processes_starting_at_once_do_not_race(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    folder = copy_migrations(tmp_path)
    # Slow enough that, without the lock, both would be inside it at the same time.
    (folder / "0002_slow.sql").write_text("SELECT pg_sleep(0.5); CREATE TABLE slow (v int);")
    first, second = await asyncio.gather(
        apply_migrations(empty_db_dsn, folder), apply_migrations(empty_db_dsn, folder)
    )
    assert sorted([first, second]) == [[], ["0001_initial.sql", "0002_slow.sql"]]
    assert len(await applied_versions(empty_db_dsn)) == 2


# ``llm-batch migrate``, run as a user runs it.


async def run_cli(
    dsn: str, folder: Path | None, cwd: Path, *, python_path: Path | None = None
) -> tuple[int, str, str]:
    """``llm-batch migrate`` with ``folder``'s files (None: the shipped ones);
    ``python_path`` goes first on the child's sys.path."""
    env = {**os.environ, "LLMBATCH_POSTGRES_DSN": dsn}
    env.pop("LLMBATCH_CONFIG", None)
    env.pop("LLMBATCH_MIGRATIONS_DIR", None)
    if folder is not None:
        env["LLMBATCH_MIGRATIONS_DIR"] = str(folder)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(python_path), env.get("PYTHONPATH")]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmbatch.cli.main",
        "migrate",
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_applies_then_reports_up_to_date(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    assert await run_cli(empty_db_dsn, folder, tmp_path) == (
        0,
        "applied 0001_initial.sql\n",
        "",
    )
    assert await run_cli(empty_db_dsn, folder, tmp_path) == (
        0,
        "database schema is up to date\n",
        "",
    )


async def test_cli_refuses_a_changed_file_in_one_line(empty_db_dsn: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    await apply_migrations(empty_db_dsn, folder)
    path = folder / "0001_initial.sql"
    path.write_text(path.read_text().replace("jobs", "jobz", 1))
    code, out, err = await run_cli(empty_db_dsn, folder, tmp_path)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith("error: migrations not applied: 0001_initial.sql changed")


async def test_cli_reports_an_unreachable_database(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    dsn = f"postgresql://someone:s3cret@127.0.0.1:{port}/llmbatch"
    code, out, err = await run_cli(dsn, None, tmp_path)
    assert (code, out) == (1, "")
    assert err.startswith(f"error: cannot reach Postgres at 127.0.0.1:{port}/llmbatch: ")
    assert err.count("\n") == 1
    assert "s3cret" not in err


async def test_another_projects_migrations_package_does_not_shadow_ours(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    """Another project's top-level ``migrations`` package first on sys.path (Django and
    Alembic projects have one) is not ours to read: ours is ``llmbatch.migrations``."""
    foreign = tmp_path / "other-project"
    (foreign / "migrations").mkdir(parents=True)
    (foreign / "migrations" / "__init__.py").write_text("")
    (foreign / "migrations" / "0001_initial.py").write_text("# some framework's migration\n")
    shipped = sorted(p.name for p in packaged_migrations().iterdir() if p.name.endswith(".sql"))
    code, out, err = await run_cli(empty_db_dsn, None, tmp_path, python_path=foreign)
    assert (code, out, err) == (0, f"applied {', '.join(shipped)}\n", "")
