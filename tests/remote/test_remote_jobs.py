"""Jobs on a real OpenAI-compatible server (vLLM's own) behind a real gateway (nginx),
run by ``llm-batch worker remote`` processes: every item exactly once in the output,
refused rows dead-lettered, a revoked key pausing the job, and the API key nowhere."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client

from llmbatch.contract.names import RESUME_UPDATE
from llmbatch.contract.spec import SamplingSpec
from llmbatch.remote.usage import job_usage
from tests.fixtures.openai_server import CANARY_KEY
from tests.fixtures.worker_processes import job_result
from tests.remote.conftest import RemoteCase, cli, until_paused

pytestmark = pytest.mark.slow

# A text far past the tiny model's 512-token context: the server refuses it (400).
TOO_LONG = "word " * 700


async def _until(done: Callable[[], bool], *, within_s: float = 120) -> None:
    for _ in range(int(within_s / 0.2)):
        if done():
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("not reached in time")


async def _canary_in_ledger(pool: asyncpg.Pool) -> list[str]:
    """Every table of the ledger whose rows, as text, hold the canary key."""
    tables = await pool.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    found = []
    for t in tables:
        name = t["tablename"]
        hit = await pool.fetchval(
            f'SELECT count(*) FROM "{name}" x WHERE x::text LIKE $1',
            f"%{CANARY_KEY}%",
        )
        if hit:
            found.append(name)
    return found


async def _canary_in_history(client: Client, workflow_ids: list[str]) -> list[str]:
    found = []
    for wid in workflow_ids:
        history = await client.get_workflow_handle(wid).fetch_history()
        if CANARY_KEY in history.to_json():
            found.append(wid)
    return found


async def test_remote_job_exactly_once_refused_rows_dead_and_key_nowhere(
    remote: RemoteCase,
) -> None:
    settings, gateway, pool, tmp_path = remote.settings, remote.gateway, remote.pool, remote.folder
    # No rate limit: requests wait on the server only (engine-bound).
    endpoint = remote.endpoint("--input-price", "1.5", "--output-price", "2")
    rows = [
        {"id": f"r{i}", "text": TOO_LONG if i % 20 == 7 else f"Say something about {i}."}
        for i in range(60)
    ]
    spec = remote.job(endpoint, rows).model_copy(update={"id_field": "id"})
    async with remote.workers(endpoint) as procs:
        # The remote worker loads no engine: no vLLM or torch library in its memory.
        # (torch's libgomp may be there: vLLM puts it in LD_PRELOAD when it starts in
        # this test process, and worker processes inherit the environment.)
        maps = await asyncio.to_thread(Path(f"/proc/{procs[0].pid}/maps").read_text)
        assert "/vllm/" not in maps and "libtorch" not in maps
        handle = await remote.start(spec)
        summary = await asyncio.wait_for(job_result(handle), 300)
    log = procs[0].log
    # After a clean stop, which records the worker's last counts.
    status = cli(settings, "status", spec.job_id)
    shown = cli(settings, "endpoint", "show", endpoint)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (60, 57, 3)
    ids = remote.output_ids(spec.job_id)
    assert sorted(ids) == sorted(r["id"] for r in rows)
    dead = await pool.fetch(
        "SELECT item_id, error_class, error_message FROM items "
        "WHERE job_id = $1 AND status = 'dead' ORDER BY item_id",
        spec.job_id,
    )
    assert [d["item_id"] for d in dead] == ["r27", "r47", "r7"]
    assert {d["error_class"] for d in dead} == {"PromptTooLong"}
    assert all("maximum context length" in d["error_message"] for d in dead)
    assert all(len(d["error_message"]) <= 320 for d in dead)  # cut short, never a row
    # Each item reached the endpoint once: no failures, nothing to send again.
    sent = gateway.requests("/chat/completions")
    assert len(sent) == 60 and {s for _, s in sent} == {200, 400}
    per_endpoint = await job_usage(pool, job_id=spec.job_id)
    assert [u.endpoint for u in per_endpoint] == [endpoint]
    usage = per_endpoint[0].usage
    assert (usage.requests, usage.throttled, usage.retries) == (60, 0, 0)
    assert usage.prompt_tokens > 0 and usage.completion_tokens == 57 * 8
    expected = (usage.prompt_tokens * 1.5 + usage.completion_tokens * 2) / 1e6
    assert usage.cost_usd == pytest.approx(expected)
    # What operators see: the shards' summaries carry the same figures to the job's
    # workflow (its summary, its Web UI details line) and to the manifest.
    used = summary.usage.remote
    assert used is not None and (used.requests, used.throttled) == (60, 0)
    assert used.cost_usd == pytest.approx(expected)
    assert used.server_s > 0 and used.rate_wait_s < 0.1 * used.server_s
    assert used.bound == "engine-bound"
    metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    assert "endpoint: 60 requests, 0 refused with 429/503, 0 sent again; engine-bound" in (
        metadata.current_details
    )
    manifest = json.loads((tmp_path / "out" / spec.job_id / "manifest.json").read_text())
    shown_remote = manifest["usage"]["remote"]
    assert shown_remote["requests"] == 60 and shown_remote["bound"] == "engine-bound"
    assert shown_remote["cost_per_item_usd"] == pytest.approx(expected / 60)
    assert shown.returncode == 0 and "60 requests sent" in shown.stdout, shown.stdout
    assert status.returncode == 0, status.stdout + status.stderr
    lines = [line.strip() for line in status.stdout.splitlines()]
    assert any(
        line.startswith(f"endpoint {endpoint}: 60 requests, 0 refused with 429/503")
        and "engine-bound" in line
        and f"${expected / 60:.6f} per item" in line
        for line in lines
    ), status.stdout
    assert f"endpoint {endpoint} now: no rate limit; 60 requests sent" in status.stdout
    # The key: in no log, ledger row, history or output.
    assert CANARY_KEY not in log.read_text()
    assert CANARY_KEY not in status.stdout + shown.stdout
    assert await _canary_in_ledger(pool) == []
    shard_ids = [f"{spec.job_id}/shard-{n:05d}" for n in range(3)]
    assert await _canary_in_history(remote.client, [spec.job_id, *shard_ids]) == []
    for part in (tmp_path / "out").rglob("*"):
        if part.is_file():
            assert CANARY_KEY not in part.read_text(errors="replace")


async def test_revoked_key_pauses_the_job_in_seconds_and_resume_finishes_it(
    remote: RemoteCase,
) -> None:
    settings, gateway, pool = remote.settings, remote.gateway, remote.pool
    endpoint = remote.endpoint("--rpm", "600", "--max-concurrency", "4")
    rows = [{"text": f"Count to {i}."} for i in range(150)]
    spec = remote.job(endpoint, rows, shard_size=50)
    async with remote.workers(endpoint):
        handle = await remote.start(spec)
        await _until(lambda: len(gateway.requests("/chat/completions")) >= 20)
        gateway.reload(key="sk-the-key-was-rotated")  # the worker's key is refused now
        revoked_at = time.monotonic()
        progress = await until_paused(handle, within_s=30)
        paused_after = time.monotonic() - revoked_at
        assert progress.paused, "the job was not paused within 30 s of the key's revocation"
        # In a thread: this process's CPU worker answers the status query meanwhile.
        status = await asyncio.to_thread(cli, settings, "status", spec.job_id)
        await asyncio.sleep(3)  # nothing more is sent while paused
        refused = [s for _, s in gateway.requests("/chat/completions") if s == 401]
        counts = await pool.fetchrow(
            "SELECT count(*) FILTER (WHERE status = 'dead') AS dead, "
            "count(*) FILTER (WHERE status = 'succeeded') AS ok FROM items WHERE job_id = $1",
            spec.job_id,
        )
        gateway.reload(key=CANARY_KEY)  # fixed
        await handle.execute_update(RESUME_UPDATE)
        summary = await asyncio.wait_for(job_result(handle), 300)
    assert paused_after < 15
    assert counts["dead"] == 0 and counts["ok"] < 150
    # Only what was in flight when the key was refused (4 per worker) got 401s.
    assert 0 < len(refused) <= 4 * 3
    lines = [line for line in status.stdout.splitlines() if "HTTP 401" in line]
    paused = [line for line in lines if "paused by llm-batch" in line]
    assert len(paused) == 1 and "resume" in paused[0], status.stdout + status.stderr
    # The job's last error says the same, by its fault class.
    assert any("this job's last error" in line and "Refused: HTTP 401" in line for line in lines)
    remote.assert_exactly_once(spec, summary, 150)


async def test_max_cost_pauses_the_job_and_resume_goes_on_past_it(remote: RemoteCase) -> None:
    settings, pool = remote.settings, remote.pool
    # 8 completion tokens at $2,000 per million: $0.016 an item, 40 a minute. Each of the
    # two slots gets the budget every 3 s, so requests wait for it longer than for the
    # server while the server answers within 1.5 s. At 5 and then 2 a second a loaded
    # machine's server took longer than that (CI found the job "engine-bound", 47%).
    endpoint = remote.endpoint("--output-price", "2000", "--max-concurrency", "2", "--rpm", "40")
    rows = [{"text": f"Name {i}."} for i in range(40)]
    spec = remote.job(endpoint, rows).model_copy(update={"max_cost_usd": 0.3})
    async with remote.workers(endpoint):
        handle = await remote.start(spec)
        progress = await until_paused(handle, within_s=120)
        assert progress.paused, "the job was not paused at its cost cap"
        # In a thread: this process's CPU worker answers the status query meanwhile.
        status = await asyncio.to_thread(cli, settings, "status", spec.job_id)
        spent = await pool.fetchval(
            "SELECT sum(cost_usd) FROM endpoint_usage WHERE job_id = $1", spec.job_id
        )
        await handle.execute_update(RESUME_UPDATE)
        summary = await asyncio.wait_for(job_result(handle), 300)
    lines = [line for line in status.stdout.splitlines() if "cost cap reached" in line]
    assert len(lines) == 1 and f"llm-batch resume {spec.job_id}" in lines[0], (
        status.stdout + status.stderr
    )
    # Two requests at a time, 40 a minute allowed: they wait for the budget, not the server.
    assert any(
        line.strip().startswith(f"endpoint {endpoint}:") and "rate-bound" in line
        for line in status.stdout.splitlines()
    ), status.stdout
    # Costs are added up once a second and running shards read the paused flag every
    # 2 s: the job passes its cap by at most ~3 s of sending ($0.011 a second here).
    assert 0.3 <= spent < 0.3 + 0.4
    remote.assert_exactly_once(spec, summary, 40)


async def test_a_remote_job_forwards_every_request_parameter_and_keeps_every_choice(
    remote: RemoteCase,
) -> None:
    # The body sent carries the parameters an OpenAI batch line (or a job's
    # sampling.params) asks for; the server's n choices and logprobs are kept.
    endpoint = remote.endpoint("--rpm", "6000")
    rows = [{"id": f"r{i}", "text": f"Say something about {i}."} for i in range(3)]
    spec = remote.job(endpoint, rows, prefix="params")
    params = {"n": 2, "logprobs": True, "top_logprobs": 1, "presence_penalty": 0.5, "top_k": 5}
    sampling = SamplingSpec(max_tokens=4, temperature=0.8, seed=1, params=params)
    spec = spec.model_copy(update={"id_field": "id", "sampling": sampling})
    async with remote.workers(endpoint):
        summary = await remote.run(spec)
    assert (summary.items_total, summary.items_succeeded) == (3, 3)
    results = await remote.pool.fetch(
        "SELECT result, completion_tokens FROM items WHERE job_id = $1", spec.job_id
    )
    for row in results:
        result = json.loads(row["result"]) if isinstance(row["result"], str) else row["result"]
        choices = result["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert result["text"] == choices[0]["text"]
        for choice in choices:
            content = choice["logprobs"]["content"]
            assert content and all(len(step["top_logprobs"]) == 1 for step in content)
        # Usage counts both choices' tokens.
        assert row["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)
