"""The embedded stack's lifecycle, on stacks of their own (not the session's).

One stack (``own``) serves the module's tests in file order: up, up again, down and
up with data kept, then the CLI on the same stack. Failure tests use their own
state folders and fail before (or right after) starting anything.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psutil
import pytest
from botocore.exceptions import ClientError
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client

from llmbatch import storage
from llmbatch.config import Settings
from llmbatch.contract import search_attributes
from llmbatch.devstack import DevStack, DevStackError, StackStatus, isolated_settings
from llmbatch.devstack.api import DevApi
from llmbatch.devstack.demo import settings_env
from llmbatch.devstack.process import alive

pytestmark = pytest.mark.slow

PART_NAMES = ["temporal", "postgres", "seaweedfs"]


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Settings]]:
    settings = isolated_settings(tmp_path_factory.mktemp("own-stack"))
    dev = DevStack(settings)
    try:
        yield dev, settings
    finally:
        DevApi(settings).down()  # `dev up` (the CLI) starts the API server too
        dev.down()
        assert not processes_under(settings.state_dir)


def processes_under(state_dir: Path) -> list[str]:
    """Command lines of live processes that mention ``state_dir`` (the stack's servers do),
    or the folder its ``postgres`` links to (started as root from a private folder)."""
    markers = {str(state_dir.resolve()), str((state_dir / "postgres").resolve())}
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        mentioned = any(marker in cmdline for marker in markers)
        if mentioned and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(cmdline)
    return found


def http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(response.status)


def s3(settings: Settings, *, secret: str | None = None) -> Any:
    return storage.s3.s3_client(settings, max_attempts=1, secret_access_key=secret)


async def custom_search_attributes(settings: Settings) -> set[str]:
    client = await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace)
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=settings.temporal_namespace)
    )
    return set(listed.custom_attributes)


def listening_hosts(status: StackStatus) -> set[str]:
    hosts = set()
    for part in status.parts:
        assert part.pid is not None
        proc = psutil.Process(part.pid)
        for p in [proc, *proc.children(recursive=True)]:
            for conn in p.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    hosts.add(conn.laddr.ip)
    return hosts


async def test_up_starts_every_part_and_they_answer(own: tuple[DevStack, Settings]) -> None:
    dev, settings = own
    status = await asyncio.to_thread(dev.up)

    assert status.running and [p.name for p in status.parts] == PART_NAMES
    assert status.started == PART_NAMES
    assert listening_hosts(status) == {"127.0.0.1"}
    assert await asyncio.to_thread(http_status, settings.web_ui_url) == 200
    conn = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    tables = {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables")}
    await conn.close()
    assert {"jobs", "items", "dead_letters", "schema_migrations"} <= tables
    listed = s3(settings).list_objects_v2(Bucket=settings.s3_bucket)
    assert listed["ResponseMetadata"]["HTTPStatusCode"] == 200
    with pytest.raises(ClientError):
        s3(settings, secret="not-the-secret").list_objects_v2(Bucket=settings.s3_bucket)
    assert {k.name for k in search_attributes.ALL} <= await custom_search_attributes(settings)
    # Every extra port is recorded, and the pid files match.
    seaweed = status.parts[2].ports
    assert {"master", "master_grpc", "volume", "filer", "admin", "s3_grpc"} <= set(seaweed)
    for part in status.parts:
        pid_file = settings.state_dir / "run" / f"{part.name}.pid"
        assert pid_file.read_text().strip() == str(part.pid)


def test_second_up_starts_nothing_new(own: tuple[DevStack, Settings]) -> None:
    dev, _ = own
    before = dev.up()
    after = dev.up()
    assert after.started == []
    assert [p.pid for p in before.parts] == [p.pid for p in after.parts]
    assert all(p.pid for p in after.parts)


def test_up_refuses_settings_that_moved_a_running_part(own: tuple[DevStack, Settings]) -> None:
    _, settings = own
    moved = settings.model_copy(update={"temporal_ui_port": settings.temporal_ui_port + 1})
    with pytest.raises(DevStackError, match="already runs"):
        DevStack(moved).up()


async def test_down_leaves_no_process_and_data_survives(own: tuple[DevStack, Settings]) -> None:
    dev, settings = own
    await asyncio.to_thread(dev.up)
    conn = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    await conn.execute("CREATE TABLE IF NOT EXISTS keep (v text)")
    await conn.execute("INSERT INTO keep VALUES ('still here')")
    await conn.close()
    s3(settings).put_object(Bucket=settings.s3_bucket, Key="keep.txt", Body=b"still here")
    pids = [p.pid for p in dev.status().parts]

    await asyncio.to_thread(dev.down)

    assert not any(alive(pid) for pid in pids)
    assert not processes_under(settings.state_dir)
    assert not dev.status().running
    assert not list((settings.state_dir / "run").glob("*.pid"))

    status = await asyncio.to_thread(dev.up)
    assert status.started == PART_NAMES
    conn = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    assert await conn.fetchval("SELECT v FROM keep") == "still here"
    await conn.close()
    body = s3(settings).get_object(Bucket=settings.s3_bucket, Key="keep.txt")["Body"].read()
    assert body == b"still here"
    assert {k.name for k in search_attributes.ALL} <= await custom_search_attributes(settings)


def test_cli_up_status_down(own: tuple[DevStack, Settings]) -> None:
    _, settings = own
    env = {**os.environ, **settings_env(settings)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmbatch.cli.main", "dev", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    status = cli("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["parts"][0]["running"] is True

    again = cli("up")
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stdout

    api = json.loads(status.stdout)["api"]
    assert api["running"] is False  # `DevStack.up` alone (the fixture's) runs no API server
    served = cli("up", "--json")
    assert served.returncode == 0, served.stderr
    api = json.loads(served.stdout)["api"]
    assert api["running"] is True and api["key"].startswith("sk-llmb-")
    assert stat.S_IMODE(Path(api["key_file"]).stat().st_mode) == 0o600
    request = urllib.request.Request(
        f"{api['base_url']}/models", headers={"Authorization": f"Bearer {api['key']}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response) == {"object": "list", "data": []}  # no GPU worker here

    down = cli("down")
    assert down.returncode == 0, down.stderr
    stopped = cli("status", "--json")
    assert stopped.returncode == 3
    assert not any(p["running"] for p in json.loads(stopped.stdout)["parts"])
    assert json.loads(stopped.stdout)["api"]["running"] is False
    assert not processes_under(settings.state_dir)
    assert not psutil.pid_exists(api["pid"]) or psutil.Process(api["pid"]).status() == (
        psutil.STATUS_ZOMBIE
    )

    up = cli("up")
    assert up.returncode == 0, up.stderr
    for endpoint in (
        settings.temporal_address,
        settings.web_ui_url,
        settings.postgres_dsn.get_secret_value(),
        str(settings.s3_endpoint_url),
        settings.s3_bucket,
    ):
        assert endpoint in up.stdout
    assert "started: temporal, postgres, seaweedfs" in up.stdout
    # The same local key again (it is still valid), with the API's base URL.
    assert f"API key:   {api['key']}" in up.stdout and "/v1 (OpenAI Batch API" in up.stdout


@pytest.mark.parametrize(
    ("part", "port_of"),
    [("temporal", lambda s: s.temporal_port), ("seaweedfs", lambda s: s.s3_port)],
)
def test_a_taken_port_is_one_clear_error(tmp_path: Path, part: str, port_of: Any) -> None:
    settings = isolated_settings(tmp_path / "state")
    port = port_of(settings)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        began = time.monotonic()
        with pytest.raises(DevStackError) as error:
            DevStack(settings).up()
        assert time.monotonic() - began < 10

        cli = subprocess.run(
            [sys.executable, "-m", "llmbatch.cli.main", "dev", "up"],
            env={**os.environ, **settings_env(settings)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    message = str(error.value)
    assert message.startswith(f"{part}: port {port}")
    assert f"{part}.log" in message and "\n" not in message
    # Checked before anything starts: no part of this stack runs.
    assert not processes_under(settings.state_dir)
    assert cli.returncode == 1
    assert cli.stderr.strip() == f"error: {message}"


def test_a_server_that_dies_while_starting_is_one_clear_error(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "state")
    # A data folder Postgres cannot use: the server exits at once.
    data = settings.state_dir / "postgres" / "data"
    data.mkdir(parents=True)
    (data / "PG_VERSION").write_text("not a version\n")

    with pytest.raises(DevStackError) as error:
        DevStack(settings).up()

    message = str(error.value)
    assert message.startswith("postgres exited while starting")
    assert "postgres.log" in message and "\n" not in message
    # Temporal, started by the same call, was stopped again.
    assert not processes_under(settings.state_dir)
    assert not DevStack(settings).status().parts[0].running


def test_status_never_shows_the_postgres_password(tmp_path: Path) -> None:
    """``dev status`` and ``dev status --json`` (what ``dev up`` prints too) show where
    Postgres is, never its password; a stack that is not running is enough to ask."""
    settings = isolated_settings(tmp_path / "state")
    password = "pw-that-must-not-show"
    dsn = settings.postgres_dsn.get_secret_value().replace("postgres@", f"postgres:{password}@")
    env = {**os.environ, **settings_env(settings), "LLMBATCH_POSTGRES_DSN": dsn}
    for args in (["status"], ["status", "--json"]):
        shown = subprocess.run(
            [sys.executable, "-m", "llmbatch.cli.main", "dev", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 3, shown.stderr  # not running
        assert password not in shown.stdout + shown.stderr
        assert f"postgres:***@127.0.0.1:{settings.postgres_port}/llmbatch" in shown.stdout
