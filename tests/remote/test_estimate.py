"""``llm-batch submit --estimate``: what a job on an endpoint would cost, counted after
in-job deduplication and the result cache, with nothing sent and no job started;
checked against what the real server then reports for the same job."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.service import RPCError

from llmbatch.config import Settings
from tests.remote.conftest import RemoteCase, cli

DISTINCT, COPIES, MAX_TOKENS = 10, 3, 8


def _estimate(settings: Settings, endpoint: str, model: str, source: Path, out: Path) -> dict:
    done = cli(
        settings, "submit", "--endpoint", endpoint, "--model", model, "--input", str(source),
        "--user", "{{ text }}", "--max-tokens", str(MAX_TOKENS), "--output", f"file://{out}",
        "--cache", "--job-id", "estimate-only", "--estimate", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout))


async def test_estimate_counts_after_dedup_and_cache_and_sends_nothing(
    remote: RemoteCase,
) -> None:
    settings, gateway, pool, tmp_path = remote.settings, remote.gateway, remote.pool, remote.folder
    endpoint = remote.endpoint("--input-price", "100", "--output-price", "400")
    # Each distinct text three times: greedy sampling, so the job sends each once.
    rows = [{"text": f"Summarise item {i % DISTINCT} in a word."} for i in range(30)]
    spec = remote.job(endpoint, rows, max_tokens=MAX_TOKENS, prefix="estimate")
    spec = spec.model_copy(update={"cache": True})
    source = Path(spec.inputs[0])

    first = await asyncio.to_thread(
        _estimate, settings, endpoint, spec.model, source, tmp_path / "out"
    )
    assert (first["items"], first["dead"], first["deduplicated"], first["cached"]) == (30, 0, 20, 0)
    assert first["requests"] == DISTINCT and first["tokenizer"] is True
    assert first["max_completion_tokens"] == DISTINCT * MAX_TOKENS
    assert first["max_cost_usd"] == pytest.approx(
        (first["prompt_tokens"] * 100 + first["max_completion_tokens"] * 400) / 1e6
    )
    # Nothing was sent and no job started.
    assert gateway.requests("/") == []
    with pytest.raises(RPCError):
        await remote.client.get_workflow_handle("estimate-only").describe()
    assert await pool.fetchval("SELECT count(*) FROM jobs WHERE job_id = 'estimate-only'") == 0

    # The job itself: the server's own count of prompt tokens, for the same requests.
    async with remote.workers(endpoint):
        summary = await remote.run(spec)
    assert (summary.items_succeeded, summary.usage.deduplicated) == (30, 20)
    used = summary.usage.remote
    assert used is not None and used.requests == DISTINCT
    # The estimate counts the messages' text with the model's tokenizer, not the chat
    # template around it: close to the server's count, never above it here.
    assert 0.5 * used.prompt_tokens <= first["prompt_tokens"] <= used.prompt_tokens
    assert used.completion_tokens <= first["max_completion_tokens"]

    # Again, after the job: the result cache answers every item, nothing to pay.
    again = await asyncio.to_thread(
        _estimate, settings, endpoint, spec.model, source, tmp_path / "out"
    )
    assert (again["cached"], again["deduplicated"], again["requests"]) == (30, 0, 0)
    assert again["max_cost_usd"] == 0.0
    assert len(gateway.requests("/chat/completions")) == DISTINCT


async def test_estimate_needs_an_endpoint(cpu_only: Settings, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text('{"text": "hi"}\n')
    done = cli(
        cpu_only, "submit", "--model", "m", "--input", str(source), "--user", "{{ text }}",
        "--output", f"file://{tmp_path / 'out'}", "--estimate",
    )  # fmt: skip
    assert done.returncode != 0
    assert "--estimate prices a job on an endpoint: give --endpoint NAME" in done.stderr
