"""``llm-batch cache stats|purge`` as a real process against the session's Postgres, and
the job options that turn deduplication off and the cache on."""

from __future__ import annotations

import json
import uuid

import pytest

from llmbatch import ledger
from llmbatch.cli._support.options import JobOptions
from llmbatch.config import Settings
from llmbatch.contract.names import model_identity
from llmbatch.dedup import result_cache
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow


async def test_cache_stats_and_purge_by_model_and_age(stack: Settings) -> None:
    model = f"/models/cli-{uuid.uuid4().hex[:8]}"
    # Kept under the model's name, as generate stores it (a path's name, not the path).
    name = model_identity(model)
    pool = await ledger.db.create_pool(stack.postgres_dsn.get_secret_value())
    try:
        await result_cache.store(
            pool,
            model=name,
            weights="sha256:abc",
            job_id="cli-cache",
            entries=[
                result_cache.NewEntry(f"{model}-{i}", {"text": str(i)}, 2, 1, f"r{i}")
                for i in range(3)
            ],
        )
    finally:
        await pool.close()

    code, out, _ = await cli(stack, "cache", "stats", "--json")
    (mine,) = [s for s in json.loads(out) if s["model"] == name]
    assert code == 0 and (mine["entries"], mine["hits"], mine["weights"]) == (3, 0, "sha256:abc")

    code, out, _ = await cli(stack, "cache", "purge", "--older-than", "30d", "--model", model)
    assert code == 0 and out.strip() == "deleted 0 cached results"
    code, out, _ = await cli(stack, "cache", "purge", "--model", model + "/", "--json")
    assert code == 0 and json.loads(out) == {"deleted": 3}

    code, _, err = await cli(stack, "cache", "purge", "--older-than", "a month")
    assert code == 1 and "30d" in err and len(err.strip().splitlines()) == 1


def test_no_dedup_and_cache_options_reach_the_spec(stack: Settings) -> None:
    base = {"inputs": ["s3://b/in.jsonl"], "model": "m", "user": "{{ text }}"}
    spec = JobOptions(**base).to_spec(stack)  # type: ignore[arg-type]
    assert (spec.dedup, spec.cache) == (True, None)
    spec = JobOptions(**base, dedup=False, cache=True).to_spec(stack)  # type: ignore[arg-type]
    assert (spec.dedup, spec.cache) == (False, True)
