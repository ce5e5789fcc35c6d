"""The embedded stack's lifecycle, on a stack of its own (not the session's)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import boto3
import pytest
from botocore.config import Config
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client

from llmbatch import search_attributes
from llmbatch.config import Settings
from llmbatch.demo import settings_env
from llmbatch.devstack import DevStack, DevStackError
from llmbatch.devstack.process import alive
from tests.fixtures.stack import stack_settings_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Settings]]:
    settings = stack_settings_for(tmp_path_factory.mktemp("own-stack"))
    dev = DevStack(settings)
    try:
        yield dev, settings
    finally:
        dev.down()


def http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(response.status)


def s3(settings: Settings):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key_id.get_secret_value(),
        aws_secret_access_key=settings.s3_secret_access_key.get_secret_value(),
        config=Config(s3={"addressing_style": "path"}),
    )


async def test_up_starts_every_part_and_they_answer(own: tuple[DevStack, Settings]) -> None:
    dev, settings = own
    status = dev.up()

    assert status.running and [p.name for p in status.parts] == [
        "temporal",
        "postgres",
        "seaweedfs",
    ]
    assert await asyncio.to_thread(http_status, settings.web_ui_url) == 200
    conn = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    tables = {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables")}
    await conn.close()
    assert {"jobs", "items", "dead_letters", "schema_migrations"} <= tables
    assert s3(settings).head_bucket(Bucket=settings.s3_bucket)
    client = await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace)
    attrs = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=settings.temporal_namespace)
    )
    assert {k.name for k in search_attributes.ALL} <= set(attrs.custom_attributes)


def test_second_up_starts_nothing_new(own: tuple[DevStack, Settings]) -> None:
    dev, _ = own
    before = {p.name: p.pid for p in dev.up().parts}
    after = {p.name: p.pid for p in dev.up().parts}
    assert before == after and all(before.values())


async def test_down_leaves_no_process_and_data_survives(own: tuple[DevStack, Settings]) -> None:
    dev, settings = own
    dev.up()
    conn = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    await conn.execute("CREATE TABLE IF NOT EXISTS keep (v text)")
    await conn.execute("INSERT INTO keep VALUES ('still here')")
    await conn.close()
    s3(settings).put_object(Bucket=settings.s3_bucket, Key="keep.txt", Body=b"still here")
    pids = [p.pid for p in dev.status().parts]

    dev.down()

    assert not any(alive(pid) for pid in pids)
    assert not dev.status().running
    dev.up()
    conn = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    assert await conn.fetchval("SELECT v FROM keep") == "still here"
    await conn.close()
    body = s3(settings).get_object(Bucket=settings.s3_bucket, Key="keep.txt")["Body"].read()
    assert body == b"still here"


def test_a_taken_port_is_one_clear_error(tmp_path: Path) -> None:
    settings = stack_settings_for(tmp_path / "state")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", settings.temporal_port))
        squatter.listen()
        with pytest.raises(DevStackError) as error:
            DevStack(settings).up()
    message = str(error.value)
    assert "temporal" in message and str(settings.temporal_port) in message
    assert "temporal.log" in message and "\n" not in message
    DevStack(settings).down()


def test_cli_up_status_down(tmp_path: Path) -> None:
    settings = stack_settings_for(tmp_path / "cli-state")
    env = settings_env(settings)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        import os

        return subprocess.run(
            [sys.executable, "-m", "llmbatch.cli.main", "dev", *args],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=180,
        )

    try:
        up = cli("up")
        assert up.returncode == 0, up.stderr
        assert settings.web_ui_url in up.stdout and settings.temporal_address in up.stdout
        status = cli("status", "--json")
        assert status.returncode == 0
        assert '"running": true' in status.stdout
    finally:
        down = cli("down")
    assert down.returncode == 0
    assert cli("status").returncode == 3
