"""The embedded stack's API server: ``llm-batch dev up`` also runs ``llm-batch serve``
on 127.0.0.1 and makes a local API key, so an OpenAI client works against it at once.

Kept beside the stack's parts, not among them: it is llm-batch's own process, not a
third-party server, and tests that start the stack need no API server. Its state is in
the stack's folder: ``api.json`` (pid, start time, port), ``api-key`` (the local key,
mode 0600) and ``logs/api.log``.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import BaseModel

from llmbatch.config import Settings
from llmbatch.devstack import process
from llmbatch.devstack.parts import run_async

NAME = "api"
LOCAL_PROJECT = "local"
READY_WITHIN_S = 90.0


class ApiStatus(BaseModel):
    """Where the API answers and the key to call it with."""

    running: bool
    pid: int | None
    base_url: str | None
    key: str | None
    key_file: str
    log: str

    def describe(self) -> str:
        if not self.running:
            return f"  API:       stopped (log {self.log})"
        return (
            f"  API:       {self.base_url} (OpenAI Batch API; pid {self.pid}, log {self.log})\n"
            f"  API key:   {self.key} (project {LOCAL_PROJECT}; also in {self.key_file})"
        )


class _Record(BaseModel):
    """What ``api.json`` holds: the running server's pid, start time and port."""

    pid: int | None = None
    started: float | None = None
    port: int | None = None

    @property
    def running(self) -> bool:
        return process.alive(self.pid, self.started)


class DevApi:
    """``llm-batch serve`` for the stack in ``settings.state_dir``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = settings.state_dir.resolve()
        self.log = self.state / "logs" / f"{NAME}.log"
        self._file = self.state / "api.json"
        self._key_file = self.state / "api-key"
        self._lock = self.state / "api.lock"

    def up(self) -> ApiStatus:
        """Make the local key (once) and start the server unless it runs; wait until it
        answers. Port: ``Settings.api_port`` when free, else a free one."""
        with process.locked(self._lock):
            key = self._local_key()
            record = self._load()
            if not record.running:
                port = self.settings.api_port
                if not process.port_free(port):
                    port = process.free_port()
                record = self._start(port)
            return self._status(record, key)

    def down(self) -> None:
        with process.locked(self._lock):
            record = self._load()
            if record.running:
                process.stop(record.pid)
            self._file.unlink(missing_ok=True)

    def status(self) -> ApiStatus:
        key = self._key_file.read_text().strip() if self._key_file.is_file() else None
        return self._status(self._load(), key)

    def _start(self, port: int) -> _Record:
        from llmbatch.devstack.demo import settings_env

        pid = process.start(
            [sys.executable, "-m", "llmbatch.cli.main", "serve", "--port", str(port)],
            log=self.log,
            env=settings_env(self.settings),
        )
        record = _Record(pid=pid, started=process.started_at(pid), port=port)
        self._save(record)

        def ready() -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            except urllib.error.HTTPError as exc:
                return exc.code == 401  # up, and asking for a key
            return False

        try:
            process.wait_ready(NAME, ready, pid=pid, log=self.log, within_s=READY_WITHIN_S)
        except BaseException:
            process.stop(pid)
            self._file.unlink(missing_ok=True)
            raise
        return record

    def _local_key(self) -> str:
        """The key in ``api-key`` while the database knows it, else a new one."""
        from llmbatch import ledger
        from llmbatch.api import auth
        from llmbatch.ledger import api_records

        async def ensure(saved: str | None) -> str | None:
            pool = await ledger.db.create_pool(
                self.settings.postgres_dsn.get_secret_value(), max_size=1
            )
            try:
                if saved and await api_records.project_of_key(pool, key_hash=auth.hash_key(saved)):
                    return None
                return (await auth.create_key(pool, project=LOCAL_PROJECT)).secret
            finally:
                await pool.close()

        saved = self._key_file.read_text().strip() if self._key_file.is_file() else None
        new = run_async(ensure(saved))
        if new is None:
            assert saved is not None
            return saved
        _write_private(self._key_file, new + "\n")
        return new

    def _status(self, record: _Record, key: str | None) -> ApiStatus:
        running = record.running
        return ApiStatus(
            running=running,
            pid=record.pid if running else None,
            base_url=f"http://127.0.0.1:{record.port}/v1" if running else None,
            key=key,
            key_file=str(self._key_file),
            log=str(self.log),
        )

    def _load(self) -> _Record:
        try:
            return _Record.model_validate_json(self._file.read_text())
        except (FileNotFoundError, ValueError):
            return _Record()

    def _save(self, record: _Record) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json())
        tmp.replace(self._file)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read, private before the secret goes in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
