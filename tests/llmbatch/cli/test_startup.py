"""The CLI starts light: ``llm-batch --help`` (and a command's ``--help``) imports
typer and rich, not the parts a command needs only when it runs. Checked by the set
of modules a fresh interpreter has imported once the help is printed; the CPU time
this saves is measured by benchmarks/cli_startup.py (figures in docs/benchmarks.md),
not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# What the commands use when they run: Temporal's SDK, the contract's models and the
# settings (pydantic), Postgres, the object store, Parquet, templates, telemetry, the
# engines and the API server.
HEAVY = (
    "pydantic",
    "pydantic_settings",
    "temporalio",
    "asyncpg",
    "boto3",
    "botocore",
    "pyarrow",
    "jinja2",
    "jsonschema",
    "opentelemetry",
    "cryptography",
    "httpx",
    "fastapi",
    "uvicorn",
    "vllm",
    "torch",
)

_RUN = """
import json, sys
out, *args = sys.argv[1:]
sys.argv = ["llm-batch", *args]
from llmbatch.cli.main import app
try:
    app()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def _help_imports(tmp_path: Path, *args: str) -> list[str]:
    out = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: llm-batch" in done.stdout
    found = json.loads(out.read_text())
    assert found["code"] == 0
    return list(found["modules"])


@pytest.mark.parametrize(
    "args",
    [("--help",), ("status", "--help"), ("submit", "--help"), ("schedule", "create", "--help")],
)
def test_help_imports_none_of_what_commands_need_to_run(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    modules = _help_imports(tmp_path, *args)
    assert "typer" in modules and "llmbatch.cli.jobs" in modules
    tops = {m.split(".")[0] for m in modules}
    # Typer itself validates a command's parameters with pydantic once it parses them
    # (typer._adapters), so a command's --help has pydantic, but none of our models.
    allowed = {"pydantic"} if "typer._adapters" in modules else set()
    assert sorted(tops & set(HEAVY) - allowed) == []
    ours = [m for m in modules if m.startswith("llmbatch.")]
    assert [m for m in ours if m.startswith(("llmbatch.config", "llmbatch.client"))] == []
    models = ("llmbatch.contract.spec", "llmbatch.contract.messages", "llmbatch.contract.priority")
    assert [m for m in ours if m.startswith(models)] == []


def test_the_top_level_help_imports_no_pydantic(tmp_path: Path) -> None:
    assert [m for m in _help_imports(tmp_path, "--help") if m.split(".")[0] == "pydantic"] == []


_RUN_TO_EXIT = """
import atexit, json, sys
out, *args = sys.argv[1:]
sys.argv = ["llm-batch", *args]
atexit.register(lambda: json.dump(sorted(sys.modules), open(out, "w")))
from llmbatch.cli.main import app
app()
"""


def test_status_loads_no_tracing_sdk_no_worker_and_no_crypto_without_a_keyring(
    tmp_path: Path,
) -> None:
    # A read-only call starts no trace: the OpenTelemetry SDK, Temporal's tracing
    # interceptor (which imports temporalio.worker) and cryptography stay unloaded.
    # Temporal is unreachable here (port 1): status gets as far as connecting.
    out = tmp_path / "modules.json"
    env = {**os.environ, "LLMBATCH_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_TO_EXIT, str(out), "status", "some-job"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode != 0 and "cannot reach Temporal" in done.stderr, done.stderr
    modules = json.loads(out.read_text())
    assert "temporalio.client" in modules  # it did try to connect
    loaded = [
        m
        for m in ("temporalio.worker", "opentelemetry.sdk.trace", "cryptography", "jinja2")
        if m in modules
    ]
    assert loaded == []
