"""DevStack: bring the embedded stack up, report on it, take it down."""

from __future__ import annotations

import json

from pydantic import BaseModel

from llmbatch.config import Settings
from llmbatch.devstack import process
from llmbatch.devstack.parts import Part, PostgresPart, SeaweedPart, TemporalPart

# Ports the settings do not name; chosen free once, then kept in the state file.
_EXTRA_PORTS = {
    "temporal": ["http", "metrics"],
    "postgres": [],
    "seaweedfs": [
        "s3_grpc", "master", "master_grpc", "volume", "volume_grpc",
        "filer", "filer_grpc", "admin", "admin_grpc",
    ],
}  # fmt: skip


class PartStatus(BaseModel):
    name: str
    running: bool
    pid: int | None
    endpoint: str
    log: str


class StackStatus(BaseModel):
    state_dir: str
    parts: list[PartStatus]
    temporal_address: str
    namespace: str
    web_ui: str
    postgres_dsn: str
    s3_endpoint: str | None
    s3_bucket: str

    @property
    def running(self) -> bool:
        return all(p.running for p in self.parts)

    def describe(self) -> str:
        lines = [f"llm-batch dev stack ({self.state_dir}):"]
        for p in self.parts:
            state = f"running (pid {p.pid})" if p.running else "stopped"
            lines.append(f"  {p.name:<10} {state:<22} {p.endpoint}")
        lines += [
            f"  Temporal:  {self.temporal_address} (namespace {self.namespace})",
            f"  Web UI:    {self.web_ui}",
            f"  Postgres:  {self.postgres_dsn}",
            f"  S3:        {self.s3_endpoint} (bucket {self.s3_bucket})",
        ]
        return "\n".join(lines)


class DevStack:
    """The embedded stack whose state lives in ``settings.state_dir``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = settings.state_dir.resolve()
        self._file = self.state / "stack.json"

    def _parts(self) -> list[Part]:
        saved = self._load()
        parts: list[Part] = [
            TemporalPart("temporal", self.settings),
            PostgresPart("postgres", self.settings),
            SeaweedPart("seaweedfs", self.settings),
        ]
        for part in parts:
            record = saved.get(part.name, {})
            part.pid = record.get("pid")
            part.ports = dict(record.get("ports", {}))
        return parts

    def _load(self) -> dict[str, dict]:
        try:
            return json.loads(self._file.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def _save(self, parts: list[Part]) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        data = {p.name: {"pid": p.pid, "ports": p.ports} for p in parts}
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self._file)

    def up(self) -> StackStatus:
        """Start what is not running (in order: Temporal, Postgres, S3); idempotent."""
        parts = self._parts()
        try:
            for part in parts:
                if process.alive(part.pid):
                    continue
                part.pid = None
                self._assign_ports(part, parts)
                part.check_ports()
                for port in self._named_ports(part):
                    if not process.port_free(port):
                        raise process.DevStackError(
                            f"{part.name}: port {port} on 127.0.0.1 is already in use by another "
                            f"program; free it or change the setting (log: {part.log})"
                        )
                part.start()
                self._save(parts)
        finally:
            self._save(parts)
        return self._status(parts)

    def _named_ports(self, part: Part) -> list[int]:
        s = self.settings
        return {
            "temporal": [s.temporal_port, s.temporal_ui_port],
            "postgres": [s.postgres_port],
            "seaweedfs": [s.s3_port],
        }[part.name]

    def _assign_ports(self, part: Part, parts: list[Part]) -> None:
        taken = {p for other in parts for p in other.ports.values()}
        taken |= {p for other in parts for p in self._named_ports(other)}
        for name in _EXTRA_PORTS[part.name]:
            port = part.ports.get(name)
            if port is None or not process.port_free(port):
                port = process.free_port(avoid=taken)
                part.ports[name] = port
            taken.add(port)

    def down(self) -> None:
        """Stop every part; nothing of the stack keeps running."""
        parts = self._parts()
        for part in reversed(parts):
            part.stop()
        self._save(parts)

    def status(self) -> StackStatus:
        return self._status(self._parts())

    def _status(self, parts: list[Part]) -> StackStatus:
        s = self.settings
        return StackStatus(
            state_dir=str(self.state),
            parts=[
                PartStatus(
                    name=p.name,
                    running=process.alive(p.pid),
                    pid=p.pid if process.alive(p.pid) else None,
                    endpoint=p.endpoint(),
                    log=str(p.log),
                )
                for p in parts
            ],
            temporal_address=s.temporal_address,
            namespace=s.temporal_namespace,
            web_ui=s.web_ui_url,
            postgres_dsn=s.postgres_dsn.get_secret_value(),
            s3_endpoint=s.s3_endpoint_url,
            s3_bucket=s.s3_bucket,
        )
