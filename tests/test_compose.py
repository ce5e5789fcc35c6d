"""docker-compose.yml, the Dockerfile and deploy/, checked without a Docker engine.

Each check reads the parsed files and returns its problems as sentences; the real files
must have none, and each check is shown to catch the mistake it exists for on an edited
copy. What is checked: the llm-batch commands parse with the real CLI, LLMBATCH_* names
real settings with valid values, addresses and credentials agree between services and
with the servers' own flags and config, images are pinned, host ports bind 127.0.0.1
and match the default settings, the image installs a built wheel, not the source tree
(tests/test_wheel.py builds one from the Dockerfile's COPY lines and runs it). One test
also runs deploy/temporal/create-namespace.sh with the real Temporal CLI against the
session's Temporal.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import shlex
import sys
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml
from pydantic import TypeAdapter, ValidationError
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from typer.core import TyperGroup

from llmbatch.cli.main import app
from llmbatch.config import CONFIG_ENV_VAR, Settings
from llmbatch.contract import search_attributes

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
COLLECTOR_CONFIG = ROOT / "deploy" / "otel-collector" / "config.yaml"
NAMESPACE_SCRIPT = ROOT / "deploy" / "temporal" / "create-namespace.sh"

Compose = dict[str, Any]
Check = Callable[[Compose], list[str]]

# --- reading the files --------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?::?-(?P<default>[^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` with every variable unset: the file's defaults."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group("default") or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose() -> Compose:
    data: Compose = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))
    return data


def services(compose: Compose) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose.get("services") or {}
    return found


def env(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: "" if v is None else str(v) for k, v in raw.items()}


def command(service: dict[str, Any]) -> list[str]:
    raw = service.get("command") or []
    return shlex.split(raw) if isinstance(raw, str) else [str(a) for a in raw]


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``-name=value`` in a command line."""
    for arg in argv:
        if arg.startswith(f"-{name}="):
            return arg.split("=", 1)[1]
    return None


def listens(service: dict[str, Any]) -> set[int]:
    """Container ports a service declares: ``expose`` and the container side of ``ports``."""
    found = {int(str(p).split("/")[0]) for p in service.get("expose") or []}
    for mapping in service.get("ports") or []:
        found.add(int(str(mapping).split("/")[0].rsplit(":", 1)[-1]))
    return found


def published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) for each ``ports`` entry."""
    found = []
    for mapping in service.get("ports") or []:
        parts = str(mapping).split("/")[0].split(":")
        ip = parts[0] if len(parts) == 3 else ""
        found.append((ip, int(parts[-2]) if len(parts) > 1 else 0, int(parts[-1])))
    return found


def default_settings() -> Settings:
    # The model's defaults, not this process's environment (the session stack sets
    # LLMBATCH_* while it runs).
    return Settings.model_construct(**{n: f.default for n, f in Settings.model_fields.items()})


# --- checks -------------------------------------------------------------------------


def cli_problems(argv: list[str]) -> list[str]:
    """Parse ``argv`` with the real CLI, as the process would, without running it."""
    if not argv or argv[0] != "llm-batch":
        return [f"{argv!r} does not start with llm-batch"]
    cmd: Any = typer.main.get_command(app)
    path = ["llm-batch"]
    rest = argv[1:]
    while isinstance(cmd, TyperGroup):
        if not rest or rest[0] not in cmd.commands:
            return [f"{' '.join(path)} has no command {rest[0] if rest else '(none)'!r}"]
        path.append(rest[0])
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    try:
        cmd.make_context(" ".join(path), list(rest))
    except Exception as exc:
        return [f"{' '.join(argv)}: {exc}"]
    return []


def check_commands(compose: Compose) -> list[str]:
    """Every service built from the Dockerfile runs an llm-batch command the CLI has."""
    problems = []
    for name, service in services(compose).items():
        argv = command(service)
        if "build" in service or argv[:1] == ["llm-batch"]:
            problems += [f"{name}: {p}" for p in cli_problems(argv)]
    return problems


def check_settings(compose: Compose) -> list[str]:
    """Every LLMBATCH_* variable is a Settings field, and its value a valid one."""
    fields = {f"LLMBATCH_{n.upper()}": f for n, f in Settings.model_fields.items()}
    anchors = [v for k, v in compose.items() if k.startswith("x-") and isinstance(v, dict)]
    problems = []
    for where, variables in [("x-anchor", a) for a in anchors] + [
        (name, env(s)) for name, s in services(compose).items()
    ]:
        for key, value in variables.items():
            if not key.startswith("LLMBATCH_") or key == CONFIG_ENV_VAR:
                continue
            if key not in fields:
                problems.append(f"{where}: {key} is not a setting")
                continue
            annotation = fields[key].annotation
            assert annotation is not None  # every setting is annotated
            try:
                TypeAdapter(annotation).validate_python(value)
            except ValidationError as exc:
                problems.append(f"{where}: {key}={value!r}: {exc.errors()[0]['msg']}")
    return problems


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


def check_images(compose: Compose) -> list[str]:
    """Every image has a version tag (not 'latest') or a digest."""
    problems = []
    for name, service in services(compose).items():
        image = service.get("image")
        if image is None:
            problems.append(f"{name}: no image name (a built image needs a tag too)")
        elif not _pinned(str(image)):
            problems.append(f"{name}: image {image!r} is not pinned")
    return problems


def check_addresses(compose: Compose) -> list[str]:
    """Addresses point at a service that listens on that port, and the servers' own
    flags and config listen where the services say."""
    svc = services(compose)
    problems = []

    def target(where: str, what: str, host: str | None, port: int | None) -> None:
        if host not in svc:
            problems.append(f"{where}: {what} names {host!r}, which is not a service")
        elif port not in listens(svc[host]):
            problems.append(f"{where}: {what} uses port {port}, but {host} listens on "
                            f"{sorted(listens(svc[host]))}")  # fmt: skip

    for name, service in svc.items():
        variables = env(service)
        for key in ("LLMBATCH_TEMPORAL_ADDRESS", "TEMPORAL_ADDRESS"):
            if key in variables:
                host, _, port_text = variables[key].rpartition(":")
                target(name, key, host, int(port_text))
        for key in ("LLMBATCH_S3_ENDPOINT_URL", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            if key in variables:
                url = urlsplit(variables[key])
                target(name, key, url.hostname, url.port)
        if "LLMBATCH_POSTGRES_DSN" in variables:
            url = urlsplit(variables["LLMBATCH_POSTGRES_DSN"])
            target(name, "LLMBATCH_POSTGRES_DSN", url.hostname, url.port or 5432)
        if "POSTGRES_SEEDS" in variables:
            target(name, "POSTGRES_SEEDS", variables["POSTGRES_SEEDS"], int(variables["DB_PORT"]))

    s3_port = flag(command(svc.get("s3", {})), "s3.port")
    if s3_port is None or int(s3_port) not in listens(svc.get("s3", {})):
        problems.append(f"s3: serves S3 on {s3_port}, not on a port it declares")
    collector = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    protocols = collector["receivers"]["otlp"]["protocols"]
    for name, service in svc.items():
        variables = env(service)
        if "OTEL_EXPORTER_OTLP_ENDPOINT" not in variables:
            continue
        protocol = variables.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        receiver = protocols.get("grpc" if protocol == "grpc" else "http") or {}
        port = int(str(receiver.get("endpoint", ":0")).rsplit(":", 1)[1])
        if urlsplit(variables["OTEL_EXPORTER_OTLP_ENDPOINT"]).port != port:
            problems.append(f"{name}: OTLP {protocol} goes to a port the collector's "
                            f"{protocol} receiver is not on ({port})")  # fmt: skip
    return problems


def check_credentials(compose: Compose) -> list[str]:
    """Users, passwords, databases, buckets and the namespace agree between services."""
    svc = services(compose)
    problems = []
    ledger, s3, temporal_db = env(svc["ledger-db"]), svc["s3"], env(svc["temporal-db"])
    for name, service in svc.items():
        variables = env(service)
        if "LLMBATCH_POSTGRES_DSN" in variables:
            dsn = urlsplit(variables["LLMBATCH_POSTGRES_DSN"])
            given = (dsn.username, dsn.password, dsn.path.lstrip("/"))
            wanted = (ledger["POSTGRES_USER"], ledger["POSTGRES_PASSWORD"], ledger["POSTGRES_DB"])
            if given != wanted:
                problems.append(f"{name}: the DSN's user/password/database are not ledger-db's")
        if "LLMBATCH_S3_ACCESS_KEY_ID" in variables:
            keys = (
                variables["LLMBATCH_S3_ACCESS_KEY_ID"],
                variables["LLMBATCH_S3_SECRET_ACCESS_KEY"],
            )
            if keys != (env(s3)["AWS_ACCESS_KEY_ID"], env(s3)["AWS_SECRET_ACCESS_KEY"]):
                problems.append(f"{name}: S3 credentials are not the s3 service's")
            if variables.get("LLMBATCH_S3_BUCKET") != flag(command(s3), "bucket"):
                problems.append(f"{name}: bucket {variables.get('LLMBATCH_S3_BUCKET')!r} is "
                                "not the one the s3 service creates")  # fmt: skip
        if "POSTGRES_SEEDS" in variables:
            password = variables.get("POSTGRES_PWD") or variables.get("SQL_PASSWORD")
            if (variables["POSTGRES_USER"], password) != (
                temporal_db["POSTGRES_USER"],
                temporal_db["POSTGRES_PASSWORD"],
            ):
                problems.append(f"{name}: Temporal's database user/password are not temporal-db's")
    namespaces = {name: env(s).get("LLMBATCH_TEMPORAL_NAMESPACE") for name, s in svc.items()} | {
        "temporal-namespace": env(svc["temporal-namespace"]).get("NAMESPACE"),
        "temporal-ui": env(svc["temporal-ui"]).get("TEMPORAL_DEFAULT_NAMESPACE"),
    }
    if len({ns for ns in namespaces.values() if ns}) != 1:
        problems.append(f"the services disagree on the namespace: {namespaces}")
    return problems


def _sa_type(key: Any) -> str:
    name = IndexedValueType.Name(IndexedValueType.ValueType(key.indexed_value_type.value))
    return name.removeprefix("INDEXED_VALUE_TYPE_").title().replace("_", "")


def check_search_attributes(compose: Compose) -> list[str]:
    """The namespace job registers exactly the search attributes jobs set."""
    wanted = {key.name: _sa_type(key) for key in search_attributes.ALL}
    raw = env(services(compose)["temporal-namespace"]).get("SEARCH_ATTRIBUTES", "")
    given = dict(pair.split("=", 1) for pair in raw.split())
    return [] if given == wanted else [f"SEARCH_ATTRIBUTES is {given}, jobs set {wanted}"]


def check_host_ports(compose: Compose) -> list[str]:
    """Published ports bind 127.0.0.1, and the default settings reach the stack."""
    svc = services(compose)
    problems = [
        f"{name}: port {host_port} is published on {ip or 'every address'}, not 127.0.0.1"
        for name, service in svc.items()
        for ip, host_port, _ in published(service)
        if ip != "127.0.0.1"
    ]
    defaults = default_settings()
    s3_endpoint = defaults.s3_endpoint_url or ""
    expected = {
        "temporal": (defaults.temporal_port, None),
        "temporal-ui": (defaults.temporal_ui_port, env(svc["temporal-ui"]).get("TEMPORAL_UI_PORT")),
        "s3": (urlsplit(s3_endpoint).port, None),
        "api": (defaults.api_port, _option(command(svc["api"]), "--port")),
    }
    for name, (host_port, container_port) in expected.items():
        ports = published(svc[name])
        if host_port not in [p[1] for p in ports]:
            problems.append(f"{name}: not published on {host_port}, the default setting")
        if container_port and int(container_port) not in [p[2] for p in ports]:
            problems.append(f"{name}: serves on {container_port}, not on the published port")
    return problems


def _option(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in a command (``--port 8000``)."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def check_wiring(compose: Compose) -> list[str]:
    """depends_on names services, mounted files exist, the GPU worker gets a GPU,
    Temporal's server and admin tools are the same release, the collector's pipelines
    use components it defines."""
    svc = services(compose)
    problems = []
    for name, service in svc.items():
        for dep in service.get("depends_on") or []:
            if dep not in svc:
                problems.append(f"{name}: depends on {dep!r}, which is not a service")
        for volume in service.get("volumes") or []:
            source = str(volume).split(":")[0]
            if source.startswith(".") and not (ROOT / source).exists():
                problems.append(f"{name}: mounts {source}, which does not exist")
    gpu = svc["gpu-worker"]
    devices = gpu.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    if not any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices or []
    ):
        problems.append("gpu-worker: no NVIDIA GPU reserved")
    if command(gpu)[1:4] != ["worker", "gpu", "--model"]:
        problems.append("gpu-worker: does not run `llm-batch worker gpu --model ...`")
    releases = {
        svc[n]["image"].rsplit(":", 1)[1]
        for n in ("temporal", "temporal-schema", "temporal-namespace")
    }
    if len(releases) != 1:
        problems.append(f"Temporal's server and admin tools differ: {sorted(releases)}")
    collector = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    for pipeline, spec in collector["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in spec.get(kind, []):
                if component not in collector.get(kind, {}):
                    problems.append(f"collector: {pipeline} uses undefined {kind[:-1]} {component}")
    return problems


def dockerfile_problems(text: str, compose: Compose) -> list[str]:
    """The base image is pinned; the extras the compose file builds exist."""
    problems = []
    args = dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", text, re.M))
    bases = re.findall(r"^FROM\s+(\S+)", text, re.M)
    if not bases:
        problems.append("Dockerfile: no FROM")
    for base in bases:
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), base)
        if not _pinned(image):
            problems.append(f"Dockerfile: base image {image!r} is not pinned")
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    for name, service in services(compose).items():
        build = service.get("build")
        if isinstance(build, dict):
            extra = (build.get("args") or {}).get("LLMBATCH_EXTRA", "")
            if extra and extra not in extras:
                problems.append(f"{name}: builds extra {extra!r}, which pyproject.toml lacks")
    return problems


def dockerfile_stages(text: str) -> list[str]:
    """The Dockerfile's stages (each from its FROM line), continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    return [f"FROM {stage}" for stage in re.split(r"^FROM\s", joined, flags=re.M)[1:]]


def dockerfile_install_problems(text: str) -> list[str]:
    """The image gets a wheel built in an earlier stage, as `pip install llm-batch` would
    give it, not the source tree: migrations and the CLI must work from the wheel alone."""
    stages = dockerfile_stages(text)
    if len(stages) < 2:
        return ["Dockerfile: one stage; build the wheel in one, install it in the last"]
    problems = []
    if re.search(r"pip\s+install\b[^\n]*?\s(?:-e|--editable)(?:\s|=)", text):
        problems.append("Dockerfile: installs the source tree editable, not the wheel")
    if not any(re.search(r"pip\s+wheel\s|-m\s+build\b", stage) for stage in stages[:-1]):
        problems.append("Dockerfile: no earlier stage builds a wheel")
    final = stages[-1]
    if re.search(r"^(?:COPY|ADD)\s+(?!--from=)", final, re.M):
        problems.append("Dockerfile: the last stage copies files from the source tree")
    if not re.search(r"^RUN\s[^\n]*pip\s+install\s[^\n]*\.whl", final, re.M):
        problems.append("Dockerfile: the last stage installs no wheel")
    return problems


def check_dockerfile(compose: Compose) -> list[str]:
    text = DOCKERFILE.read_text()
    return dockerfile_problems(text, compose) + dockerfile_install_problems(text)


CHECKS: list[Check] = [
    check_commands,
    check_settings,
    check_images,
    check_addresses,
    check_credentials,
    check_search_attributes,
    check_host_ports,
    check_wiring,
    check_dockerfile,
]


# --- tests --------------------------------------------------------------------------


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_stack_passes(check: Check) -> None:
    assert check(load_compose()) == []


def _set(path: str, value: Any) -> Callable[[Compose], None]:
    def edit(compose: Compose) -> None:
        *parents, last = path.split("/")
        node = compose
        for part in parents:
            node = node[part]
        node[last] = value

    return edit


MISTAKES: list[tuple[Check, Callable[[Compose], None], str]] = [
    (
        check_commands,
        _set("services/cpu-worker/command", ["llm-batch", "worker", "cpux"]),
        "no command 'cpux'",
    ),
    (
        check_commands,
        _set("services/gpu-worker/command", ["llm-batch", "worker", "gpu"]),
        "Missing parameter: model",
    ),
    (
        check_commands,
        _set("services/migrate/command", ["llm-batch", "migrate", "--fast"]),
        "No such option",
    ),
    (
        check_commands,
        _set("services/migrate/command", ["python", "-m", "x"]),
        "does not start with llm-batch",
    ),
    (
        check_settings,
        _set("services/cpu-worker/environment/LLMBATCH_TEMPORAL_ADRESS", "x:1"),
        "is not a setting",
    ),
    (
        check_settings,
        _set("services/cpu-worker/environment/LLMBATCH_TEMPORAL_UI_PORT", "web"),
        "LLMBATCH_TEMPORAL_UI_PORT",
    ),
    (check_images, _set("services/ledger-db/image", "postgres:latest"), "not pinned"),
    (check_images, _set("services/s3/image", "chrislusf/seaweedfs"), "not pinned"),
    (
        check_addresses,
        _set("services/cpu-worker/environment/LLMBATCH_TEMPORAL_ADDRESS", "temporal:7234"),
        "uses port 7234",
    ),
    (
        check_addresses,
        _set("services/gpu-worker/environment/LLMBATCH_S3_ENDPOINT_URL", "http://minio:8333"),
        "not a service",
    ),
    (check_addresses, _set("services/s3/command", ["mini", "-s3.port=9000"]), "serves S3 on 9000"),
    (
        check_addresses,
        _set("services/cpu-worker/environment/OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        "OTLP http/protobuf",
    ),
    (
        check_credentials,
        _set("services/ledger-db/environment/POSTGRES_PASSWORD", "other"),
        "not ledger-db's",
    ),
    (
        check_credentials,
        _set("services/s3/environment/AWS_SECRET_ACCESS_KEY", "other"),
        "S3 credentials",
    ),
    (
        check_credentials,
        _set("services/temporal-namespace/environment/NAMESPACE", "default"),
        "disagree on the namespace",
    ),
    (
        check_search_attributes,
        _set("services/temporal-namespace/environment/SEARCH_ATTRIBUTES", "JobId=Keyword"),
        "SEARCH_ATTRIBUTES",
    ),
    (check_host_ports, _set("services/temporal/ports", ["7233:7233"]), "every address"),
    (
        check_host_ports,
        _set("services/temporal-ui/ports", ["127.0.0.1:8080:8080"]),
        "not published on 8233",
    ),
    (
        check_host_ports,
        _set("services/api/ports", ["127.0.0.1:8001:8000"]),
        "not published on 8000",
    ),
    (
        check_host_ports,
        _set("services/api/command", ["llm-batch", "serve", "--port", "9000"]),
        "serves on 9000",
    ),
    (check_wiring, _set("services/gpu-worker/deploy", {}), "no NVIDIA GPU"),
    (check_wiring, _set("services/temporal/image", "temporalio/server:1.30.0"), "differ"),
    (check_wiring, _set("services/cpu-worker/depends_on", ["temporal-frontend"]), "not a service"),
    (
        check_dockerfile,
        _set("services/gpu-worker/build", {"context": ".", "args": {"LLMBATCH_EXTRA": "cuda"}}),
        "lacks",
    ),
]


@pytest.mark.parametrize(
    ("check", "mistake", "expected"), MISTAKES, ids=[f"{c.__name__}-{e}" for c, _, e in MISTAKES]
)
def test_each_check_catches_its_mistake(
    check: Check, mistake: Callable[[Compose], None], expected: str
) -> None:
    compose = copy.deepcopy(load_compose())
    mistake(compose)
    problems = check(compose)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: t.replace("pip wheel --no-deps --wheel-dir /wheels .", "true"),
            "no earlier stage builds a wheel",
        ),
        (
            lambda t: re.sub(r'pip install "\$\(echo[^"]*"', "pip install -e /src", t),
            "installs the source tree editable",
        ),
        (lambda t: t.replace("COPY --from=build /wheels", "COPY ."), "copies files from the"),
        (lambda t: t.replace("/wheels/llm_batch-*.whl", "llm-batch"), "installs no wheel"),
        (
            lambda t: re.sub(r"^FROM [^\n]* AS build\n.*?(?=^FROM )", "", t, flags=re.M | re.S),
            "one stage",
        ),
    ],
    ids=["no-wheel-built", "editable", "source-copied", "no-wheel-installed", "one-stage"],
)
def test_a_dockerfile_that_installs_no_wheel_is_caught(
    edit: Callable[[str], str], expected: str
) -> None:
    text = DOCKERFILE.read_text()
    assert dockerfile_install_problems(text) == []
    edited = edit(text)
    assert edited != text
    assert any(expected in p for p in dockerfile_install_problems(edited))


def test_an_unpinned_dockerfile_base_is_caught() -> None:
    text = DOCKERFILE.read_text()
    assert dockerfile_problems(text, load_compose()) == []
    for base in ("python", "python:latest", "${BASE}"):
        edited = re.sub(r"^FROM \S+", f"FROM {base}", text, flags=re.M)
        assert any("not pinned" in p for p in dockerfile_problems(edited, load_compose()))


async def test_the_namespace_script_registers_the_search_attributes_jobs_set(
    stack: Settings, temporal_client: Client
) -> None:
    """deploy/temporal/create-namespace.sh, run by the real Temporal CLI against the
    session's Temporal, on a namespace of its own, twice (it must be re-runnable)."""
    namespace = f"compose-{uuid.uuid4().hex[:8]}"
    variables = env(services(load_compose())["temporal-namespace"])
    script_env = {
        **os.environ,
        # The CLI the dev stack uses, on PATH as in the admin-tools image.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TEMPORAL_ADDRESS": stack.temporal_address,
        "NAMESPACE": namespace,
        "SEARCH_ATTRIBUTES": variables["SEARCH_ATTRIBUTES"],
    }
    for _ in range(2):
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", str(NAMESPACE_SCRIPT), env=script_env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, out.decode()
    assert f"namespace {namespace} is ready" in out.decode()
    assert "search attribute JobId exists" in out.decode()

    listed = await temporal_client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace)
    )
    for key in search_attributes.ALL:
        assert listed.custom_attributes.get(key.name) == key.indexed_value_type.value, key.name
