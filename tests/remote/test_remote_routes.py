"""Models routed to an endpoint (``endpoint add|update --serve-as MODEL``), through every
way in: a batch from the official ``openai`` client against ``llm-batch serve`` runs on
the endpoint's remote worker (accepted and waiting while none runs), ``GET /v1/models``
lists the model without anything of the endpoint's, an undeclared model is refused,
and a schedule's runs and a submit call the endpoint named or the model's route."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Final

import asyncpg
import httpx
import openai
import pytest
from temporalio.client import Client

from llmbatch.config import Settings
from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.openai_server import CANARY_KEY, Gateway, OpenAIServer
from tests.llmbatch.api.helpers import (
    assert_openai_error,
    jsonl,
    new_client,
    request_line,
)
from tests.llmbatch.cli.test_schedules import finished, runs_of
from tests.remote.conftest import (
    KEY_ENV,
    add_endpoint,
    batch_on_endpoint,
    cli,
    output_ids,
    remote_workers,
)

CHAT: Final = "/v1/chat/completions"


async def test_a_batch_for_a_routed_model_waits_for_the_endpoints_worker_and_runs_there_once(
    cpu_only: Settings,
    temporal_client: Client,
    openai_server: OpenAIServer,
    gateway: Gateway,
    api_server: ApiServer,
    api_keys: Keys,
    pool: asyncpg.Pool,
    tmp_path: Path,
) -> None:
    settings = cpu_only
    model = openai_server.model
    key_file = tmp_path / "endpoint.key"
    key_file.write_text(CANARY_KEY)
    endpoint = add_endpoint(
        settings, gateway.base_url, "--api-key-file", str(key_file), "--serve-as", model
    )
    try:
        client, key = await new_client(api_server, api_keys)
        # Listed once, with its task, while no worker of the endpoint runs; nothing of
        # the endpoint's (name, URL, where the key is) is in the answer.
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
            listing = (await http.get(f"{api_server.base_url}/models")).text
        for secret in (endpoint, gateway.base_url, "127.0.0.1", KEY_ENV, str(key_file)):
            assert secret not in listing, secret
        assert CANARY_KEY not in listing
        listed = [m for m in [m async for m in client.models.list()] if m.id == model]
        assert len(listed) == 1 and listed[0].owned_by == "llm-batch"
        assert "generate" in (listed[0].model_extra or {})["tasks"]
        assert (await client.models.retrieve(model)).id == model

        # A model nobody served nor routed stays refused.
        unknown = await client.files.create(
            file=("in.jsonl", jsonl([request_line("no-such-model", 0)])), purpose="batch"
        )
        with pytest.raises(openai.BadRequestError) as caught:
            await client.batches.create(
                input_file_id=unknown.id, endpoint=CHAT, completion_window="24h"
            )
        assert_openai_error(caught.value, status=400, code="model_not_found", param="model")

        # Scaled to zero: the batch is accepted and waits on the endpoint's queue.
        lines = [request_line(model, n) for n in range(6)]
        f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        created = await client.batches.create(
            input_file_id=f.id, endpoint=CHAT, completion_window="24h"
        )
        assert created.model == model
        await asyncio.sleep(5)
        waiting = await client.batches.retrieve(created.id)
        assert waiting.status in ("validating", "in_progress"), waiting
        assert gateway.requests("/chat/completions") == []
        spec = await pool.fetchval("SELECT spec FROM jobs WHERE job_id = $1", created.id)
        assert spec["remote_endpoint"] == endpoint and spec["model"] == model

        await batch_on_endpoint(
            client, created.id, lines, settings=settings, temporal_client=temporal_client,
            endpoint=endpoint, model=model, log=tmp_path / "w.log",
        )  # fmt: skip
        # Once each on the endpoint, nothing on a GPU queue: the gateway saw every one.
        sent = gateway.requests("/chat/completions")
        assert len(sent) == 6 and {s for _, s in sent} == {200}
        usage = await pool.fetchval(
            "SELECT sum(requests) FROM endpoint_usage WHERE job_id = $1 AND endpoint = $2",
            created.id,
            endpoint,
        )
        assert usage == 6
        assert CANARY_KEY not in (tmp_path / "w.log").read_text()

        shown = await asyncio.to_thread(cli, settings, "endpoint", "show", endpoint, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["serves"] == {"generate": [model]}
    finally:
        removed = await asyncio.to_thread(cli, settings, "endpoint", "remove", endpoint)
        assert removed.returncode == 0, removed.stderr
    # The route went with the endpoint.
    assert (
        await pool.fetchval("SELECT count(*) FROM endpoint_models WHERE endpoint = $1", endpoint)
        == 0
    )


async def test_routes_are_one_endpoint_per_model_and_update_replaces_them(
    cpu_only: Settings, openai_server: OpenAIServer, gateway: Gateway
) -> None:
    settings = cpu_only
    first = add_endpoint(settings, gateway.base_url, "--serve-as", "model-a", "--serve-as", "b/")
    second = add_endpoint(settings, gateway.base_url)
    try:
        taken = await asyncio.to_thread(
            cli, settings, "endpoint", "update", second, "--serve-as", "model-a", "--rpm", "5"
        )
        assert taken.returncode == 1 and "model-a (on " + first in taken.stderr, taken.stderr
        assert len(taken.stderr.strip().splitlines()) == 1
        # Refused as a whole: the rpm did not change either.
        shown = await asyncio.to_thread(cli, settings, "endpoint", "show", second, "--json")
        assert json.loads(shown.stdout)["rpm"] is None and json.loads(shown.stdout)["serves"] == {}
        # Embeddings are routed apart from generation; an update replaces a task's list.
        moved = await asyncio.to_thread(
            cli, settings, "endpoint", "update", first, "--serve-as", "b",
            "--serve-embeddings-as", "model-a",
        )  # fmt: skip
        assert moved.returncode == 0, moved.stderr
        assert "serves b; serves model-a (embed)" in " ".join(moved.stdout.split())
        taken_now = await asyncio.to_thread(
            cli, settings, "endpoint", "update", second, "--serve-as", "model-a"
        )
        assert taken_now.returncode == 0, taken_now.stderr
        cleared = await asyncio.to_thread(
            cli, settings, "endpoint", "update", first, "--serve-as", ""
        )
        assert cleared.returncode == 0, cleared.stderr
        listed = await asyncio.to_thread(cli, settings, "endpoint", "list", "--json")
        serves = {e["name"]: e["serves"] for e in json.loads(listed.stdout)}
        assert serves[first] == {"embed": ["model-a"]}
        assert serves[second] == {"generate": ["model-a"]}
    finally:
        for name in (first, second):
            await asyncio.to_thread(cli, settings, "endpoint", "remove", name)


async def test_scheduled_runs_and_submits_call_the_endpoint_named_or_the_models_route(
    cpu_only: Settings,
    temporal_client: Client,
    openai_server: OpenAIServer,
    gateway: Gateway,
    tmp_path: Path,
) -> None:
    settings = cpu_only
    model = openai_server.model
    routed = add_endpoint(settings, gateway.base_url, "--serve-as", model)
    named = add_endpoint(settings, gateway.base_url)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"ticket {i}"}) + "\n" for i in range(8)))
    options = [
        "--input", str(data), "--model", model, "--user", "Ticket: {{ text }}",
        "--max-tokens", "4", "--shard-size", "4", "--output", f"file://{tmp_path / 'out'}",
        "--json",
    ]  # fmt: skip
    job = ["--cron", "0 2 * * *", "--paused", *options]
    by_route, by_name = f"routed-{routed}", f"named-{named}"
    try:
        refused = await asyncio.to_thread(
            cli, settings, "schedule", "create", "nowhere", *job, "--endpoint", "no-such-ep"
        )
        assert refused.returncode == 1 and "no endpoint named no-such-ep" in refused.stderr
        made = await asyncio.to_thread(cli, settings, "schedule", "create", by_route, *job)
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["endpoint"] == routed
        made = await asyncio.to_thread(
            cli, settings, "schedule", "create", by_name, *job, "--endpoint", named
        )
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["endpoint"] == named

        async with remote_workers(
            settings, temporal_client, endpoint=routed, model=model, logs=[tmp_path / "w.log"]
        ):
            triggered = await asyncio.to_thread(cli, settings, "schedule", "trigger", by_route)
            assert triggered.returncode == 0, triggered.stderr
            [run] = await runs_of(temporal_client, by_route, at_least=1)
            summary = await finished(temporal_client, run)
            # submit reads the same route (in a thread: this process's CPU worker runs
            # the job meanwhile).
            submitted = await asyncio.to_thread(cli, settings, "submit", *options, "--wait")
        assert (summary.items_total, summary.items_succeeded) == (8, 8)
        ids = output_ids(tmp_path, run)
        assert len(ids) == 8 and len(set(ids)) == 8
        assert submitted.returncode == 0, submitted.stderr
        direct = json.loads(submitted.stdout)
        assert (direct["items_total"], direct["items_succeeded"]) == (8, 8)
        assert len(set(output_ids(tmp_path, direct["job_id"]))) == 8
        # Both jobs' requests, each once, went through the endpoint's gateway.
        assert len(gateway.requests("/chat/completions")) == 16
    finally:
        for name in (by_route, by_name):
            await asyncio.to_thread(cli, settings, "schedule", "delete", name)
        for name in (routed, named):
            await asyncio.to_thread(cli, settings, "endpoint", "remove", name)
