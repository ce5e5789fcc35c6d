"""The result cache is scoped to a tenant (an API project is its batches' tenant): a
tenant's job is answered from its own earlier results, never from another tenant's,
and no ledger row of one tenant names another tenant's job or item. Real stack: the
session GPU worker (cache-keyed by its weights) and the Temporal dev server."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec

ROWS = 12


def _spec(source: Path, out: Path, model: str, *, tenant: str) -> JobSpec:
    return JobSpec(
        job_id=f"tenant-cache-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="A secret about {{ name }}.")],
        model=model,
        sampling=SamplingSpec(max_tokens=4),
        output_uri=f"file://{out}",
        id_field="id",
        cache=True,
        tenant=tenant,
    )


async def _run(client: Client, settings: Settings, spec: JobSpec) -> None:
    handle, started = await start_job(client, spec, settings=settings)
    assert started
    summary = await asyncio.wait_for(handle.result(), 300)
    assert summary.items_succeeded == ROWS


async def test_one_tenants_cached_results_never_answer_another_tenant(
    workers: Settings, temporal_client: Client, model_name: str, tmp_path: Path
) -> None:
    source = tmp_path / "rows.jsonl"
    # Prompts nobody else's test sends, so only this test's jobs can have cached them.
    marker = uuid.uuid4().hex
    source.write_text(
        "".join(json.dumps({"id": f"r{i}", "name": f"{marker} {i}"}) + "\n" for i in range(ROWS))
    )
    out = tmp_path / "out"
    alice, bob = f"alice-{marker[:6]}", f"bob-{marker[:6]}"
    first = _spec(source, out, model_name, tenant=alice)
    await _run(temporal_client, workers, first)
    other = _spec(source, out, model_name, tenant=bob)
    await _run(temporal_client, workers, other)
    again = _spec(source, out, model_name, tenant=alice)
    await _run(temporal_client, workers, again)

    pool = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value(), max_size=1)
    try:
        bobs = await ledger.usage.usage(pool, job_id=other.job_id)
        alices = await ledger.usage.usage(pool, job_id=again.job_id)
        named = await pool.fetch(
            "SELECT item_id, shared_with FROM items WHERE job_id = $1 AND shared_with IS NOT NULL",
            other.job_id,
        )
        alice_named = await pool.fetch(
            "SELECT shared_with FROM items WHERE job_id = $1 AND result_source = 'cached'",
            again.job_id,
        )
    finally:
        await pool.close()
    # Bob's identical requests were generated for him, none from Alice's results...
    assert (bobs.generated, bobs.cached) == (ROWS, 0)
    # ... and none of his rows names Alice's job.
    assert [r for r in named if first.job_id in (r["shared_with"] or "")] == []
    # Alice's own rerun is answered from her first job: the cache works within a tenant.
    assert (alices.generated, alices.cached) == (0, ROWS)
    assert {r["shared_with"].split("/")[0] for r in alice_named} == {first.job_id}
