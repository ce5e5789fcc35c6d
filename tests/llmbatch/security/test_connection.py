"""Connections to Temporal: configured by Temporal's environment configuration under
llm-batch's own settings, secured by TLS, mutual TLS or an API key, and refused in
one line that names the cause.

The secured endpoints are real: nginx (the OS package) terminates TLS in front of the
session's Temporal dev server (tests/fixtures/tls.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from llmbatch.client.temporal import TemporalUnavailable, connect, start_job
from llmbatch.config import Settings
from llmbatch.devstack.demo import settings_env
from llmbatch.security.connection import ConnectionConfigError, temporal_target
from llmbatch.workers.cpu import cpu_worker
from tests.fixtures.tls import API_KEY, TlsProxy
from tests.workflows.test_batch_job import classify_on_disk, companies


@pytest.fixture
def clean_temporal_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No TEMPORAL_* from the machine running the tests."""
    for name in [n for n in os.environ if n.startswith("TEMPORAL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_precedence_llmbatch_settings_then_temporal_environment_then_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Settings() reads LLMBATCH_* (the session stack sets them) and a local config file.
    for name in [n for n in os.environ if n.startswith("LLMBATCH_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "temporal.toml"
    toml.write_text(
        '[profile.default]\naddress = "profile-host:7233"\nnamespace = "profile-ns"\n'
        '[profile.cloud]\naddress = "cloud-host:7233"\nnamespace = "cloud-ns"\n'
        'api_key = "profile-key"\n'
    )
    base = {"TEMPORAL_CONFIG_FILE": str(toml)}

    # Nothing set anywhere: llm-batch's defaults.
    target = temporal_target(Settings(), environ={})
    assert (target.address, target.namespace, target.tls) == ("127.0.0.1:7233", "llm-batch", False)
    # The profile over the defaults; TEMPORAL_PROFILE picks another one, whose API key
    # turns TLS on.
    assert temporal_target(Settings(), environ=base).address == "profile-host:7233"
    cloud = temporal_target(Settings(), environ={**base, "TEMPORAL_PROFILE": "cloud"})
    assert (cloud.address, cloud.namespace, cloud.api_key) == (
        "cloud-host:7233",
        "cloud-ns",
        "profile-key",
    )
    assert cloud.tls is not False and "API key" in cloud.security
    assert "profile-key" not in repr(cloud)
    # The environment over the profile.
    env = {**base, "TEMPORAL_ADDRESS": "env-host:7233", "TEMPORAL_NAMESPACE": "env-ns"}
    target = temporal_target(Settings(), environ=env)
    assert (target.address, target.namespace) == ("env-host:7233", "env-ns")
    # llm-batch's own settings over both, when set.
    mine = Settings(temporal_address="mine:7233", temporal_namespace="mine-ns")
    target = temporal_target(mine, environ=env)
    assert (target.address, target.namespace) == ("mine:7233", "mine-ns")

    with pytest.raises(ConnectionConfigError, match="Profile 'nope' not found"):
        temporal_target(Settings(), environ={**base, "TEMPORAL_PROFILE": "nope"})
    with pytest.raises(ConnectionConfigError, match="TEMPORAL_CONFIG_FILE"):
        temporal_target(Settings(), environ={"TEMPORAL_CONFIG_FILE": str(tmp_path / "gone")})


async def expect_refused(settings: Settings, *fragments: str) -> str:
    with pytest.raises(TemporalUnavailable) as refused:
        await connect(settings)
    line = str(refused.value)
    assert "\n" not in line and API_KEY not in line, line
    for fragment in fragments:
        assert fragment in line, line
    return line


async def test_tls_mutual_tls_and_api_keys_connect_and_refusals_name_their_cause(
    stack: Settings, tls_proxy: TlsProxy, clean_temporal_env: pytest.MonkeyPatch
) -> None:
    env = clean_temporal_env
    certs = tls_proxy.certs

    def at(address: str) -> Settings:
        return stack.model_copy(update={"temporal_address": address})

    # TLS with the server's CA.
    env.setenv("TEMPORAL_TLS_SERVER_CA_CERT_PATH", str(certs.ca.cert))
    client = await connect(at(tls_proxy.tls))
    await client.count_workflows()
    # ... against a server whose certificate another CA signed.
    await expect_refused(at(tls_proxy.foreign), "not signed by a CA this client trusts")
    # ... against a server that speaks no TLS (the dev server itself).
    await expect_refused(at(stack.temporal_address), "does not speak TLS at this address")

    # Mutual TLS: no client certificate, an expired one, then the right one.
    await expect_refused(
        at(tls_proxy.mtls),
        f"cannot reach Temporal at {tls_proxy.mtls}",
        "requires a client certificate",
        "TEMPORAL_TLS_CLIENT_CERT_PATH",
    )
    env.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(certs.expired_client.cert))
    env.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(certs.expired_client.key))
    await expect_refused(at(tls_proxy.mtls), f"{certs.expired_client.cert} expired on")
    env.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(certs.client.cert))
    env.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(certs.client.key))
    client = await connect(at(tls_proxy.mtls))
    await client.count_workflows()
    env.delenv("TEMPORAL_TLS_CLIENT_CERT_PATH")
    env.delenv("TEMPORAL_TLS_CLIENT_KEY_PATH")

    # An API key (authorization: Bearer), as Temporal Cloud takes it.
    await expect_refused(at(tls_proxy.api_key), "requires an API key", "TEMPORAL_API_KEY")
    env.setenv("TEMPORAL_API_KEY", "not-the-key")
    line = await expect_refused(at(tls_proxy.api_key), "refused the API key (TEMPORAL_API_KEY)")
    assert "not-the-key" not in line
    env.setenv("TEMPORAL_API_KEY", API_KEY)
    client = await connect(at(tls_proxy.api_key))
    await client.count_workflows()

    # A plain-text client at a TLS address.
    for name in ("TEMPORAL_API_KEY", "TEMPORAL_TLS_SERVER_CA_CERT_PATH"):
        env.delenv(name)
    await expect_refused(
        at(tls_proxy.tls), "it speaks TLS at this address and this client does not"
    )


async def test_a_client_with_its_certificate_runs_a_job_end_to_end_over_mutual_tls(
    workers: Settings,
    tls_proxy: TlsProxy,
    clean_temporal_env: pytest.MonkeyPatch,
    tmp_path: Path,
    model_name: str,
) -> None:
    """The job's client and its CPU worker (workflows, planning, fetch, render, write)
    reach Temporal only through nginx's mutual-TLS port."""
    certs = tls_proxy.certs
    clean_temporal_env.setenv("TEMPORAL_TLS_SERVER_CA_CERT_PATH", str(certs.ca.cert))
    clean_temporal_env.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(certs.client.cert))
    clean_temporal_env.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(certs.client.key))
    settings = workers.model_copy(
        update={
            "temporal_address": tls_proxy.mtls,
            "cpu_task_queue": f"mtls-{uuid.uuid4().hex[:8]}",
        }
    )
    client: Client = await connect(settings)
    assert client.service_client.config.target_host == tls_proxy.mtls
    spec = classify_on_disk(tmp_path, companies(12), model_name, shard_size=6)
    async with cpu_worker(settings, client=client):
        handle, started = await start_job(client, spec, settings=settings)
        summary = await handle.result()
    assert started and summary.state == "succeeded"
    assert (summary.items_total, summary.items_succeeded) == (12, 12)


def run_cli(
    settings: Settings, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    return subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", *args],
        env={**clean, **settings_env(settings), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_worker_and_the_cli_refused_by_the_server_say_why_in_one_line(
    stack: Settings, tls_proxy: TlsProxy
) -> None:
    certs = tls_proxy.certs
    ca = {"TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(certs.ca.cert)}
    worker = run_cli(
        stack.model_copy(update={"temporal_address": tls_proxy.mtls}), ca, "worker", "cpu"
    )
    assert worker.returncode == 1, worker.stderr
    (line,) = worker.stderr.splitlines()
    assert (
        line.startswith("error: cannot reach Temporal at")
        and "requires a client certificate" in line
    )
    assert "polling" not in worker.stdout

    listed = run_cli(
        stack.model_copy(update={"temporal_address": tls_proxy.api_key}),
        {**ca, "TEMPORAL_API_KEY": "wrong-key-3c1d"},
        "list",
        "--json",
    )
    assert listed.returncode == 1
    (line,) = listed.stderr.splitlines()
    assert "refused the API key" in line
    assert "wrong-key-3c1d" not in listed.stdout + listed.stderr
