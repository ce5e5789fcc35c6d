"""API keys: 401 without a live key, in OpenAI's shape; keys made and revoked by the CLI;
a key sees only its own project's files and batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import asyncpg
import httpx
import openai
import pytest

from llmbatch.config import Settings
from llmbatch.devstack.demo import settings_env
from llmbatch.ledger import api_layout, api_records
from tests.fixtures.api_server import ApiServer, Keys
from tests.llmbatch.api.helpers import assert_openai_error, batch_file


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", *args],
        env={**os.environ, **settings_env(settings)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_calls_without_a_live_key_answer_401(stack: Settings, api_server: ApiServer) -> None:
    async with httpx.AsyncClient() as http:
        no_key = await http.get(f"{api_server.base_url}/files")
    assert no_key.status_code == 401
    assert no_key.json()["error"]["code"] == "invalid_api_key"
    assert set(no_key.json()["error"]) == {"message", "type", "param", "code"}

    wrong = openai.OpenAI(base_url=api_server.base_url, api_key="sk-llmb-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.files.list()
    error = assert_openai_error(caught.value, status=401, code="invalid_api_key")
    assert "sk-llmb-wrong" not in error["message"]

    created = cli(stack, "api-key", "create", "--project", "revoked-project", "--json")
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)
    client = openai.OpenAI(base_url=api_server.base_url, api_key=key["key"], max_retries=0)
    assert client.files.list().data == []
    listed = cli(stack, "api-key", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = [k for k in json.loads(listed.stdout) if k["key_id"] == key["key_id"]]
    assert row["project"] == "revoked-project" and row["revoked_at"] is None
    assert key["key"] not in listed.stdout  # only its hash is kept

    revoked = cli(stack, "api-key", "revoke", key["key_id"])
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(openai.AuthenticationError) as caught:
        client.files.list()
    assert_openai_error(caught.value, status=401, code="invalid_api_key")
    again = cli(stack, "api-key", "revoke", key["key_id"])
    assert again.returncode == 1 and "no live key" in again.stderr


async def test_a_project_cannot_see_another_projects_files_or_batches(
    api_server: ApiServer, api_keys: Keys, api_pool: asyncpg.Pool
) -> None:
    ours = openai.OpenAI(base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0)
    theirs_project = "theirs-" + api_layout.new_file_id()[-8:]
    theirs = openai.OpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(theirs_project), max_retries=0
    )
    f = theirs.files.create(file=("t.jsonl", batch_file("m", 1)), purpose="batch")
    # Their batch, recorded as the server records one (no worker needed to see it).
    batch = await api_records.insert_batch(
        api_pool,
        batch_id=api_layout.new_batch_id(),
        project=theirs_project,
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        window=timedelta(hours=24),
        model="m",
        metadata=None,
        max_in_progress=10,
    )
    assert theirs.batches.retrieve(batch.batch_id).id == batch.batch_id

    for call in (
        lambda: ours.files.retrieve(f.id),
        lambda: ours.files.content(f.id),
        lambda: ours.files.delete(f.id),
        lambda: ours.batches.retrieve(batch.batch_id),
        lambda: ours.batches.cancel(batch.batch_id),
        lambda: ours.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert_openai_error(caught.value, status=404)
    assert ours.files.list().data == [] and ours.batches.list().data == []
    assert theirs.files.retrieve(f.id).id == f.id  # still there
