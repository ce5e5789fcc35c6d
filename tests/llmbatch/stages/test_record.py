"""The record stage: a generate attempt's results reach the ledger whatever characters
the model emits."""

from __future__ import annotations

import asyncpg
import pytest

from llmbatch import ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.config import Settings
from llmbatch.contract.messages import GenerateProgress, JobLayout, ShardInput
from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec
from llmbatch.engine.requests import GenerationResult
from llmbatch.formats.records import StagedRequest
from llmbatch.stages.record import Recorder

JOB, LEASE = "nul-job", "nul-job/shard-00000/3#1"


async def test_a_nul_character_in_model_output_is_stored_not_fatal(
    ledger_pool: asyncpg.Pool,
) -> None:
    # Postgres text and jsonb cannot hold NUL; a model with random weights emits it
    # often enough that, unhandled, it failed whole shards on every retry.
    item = ledger.items.NewItem(item_id="row-0", ordinal=0, prompt_hash=None, source="rows:1")
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=[item])
    with pytest.raises(asyncpg.UntranslatableCharacterError):
        # What the recorder must not send as it is.
        raw = ledger.items.ItemResult("row-0", {"text": "a\x00b"}, 1, 1, 1.0)
        await ledger.items.claim_items(
            ledger_pool, job_id=JOB, item_ids=["row-0"], lease_owner=LEASE
        )
        await ledger.items.record_results(ledger_pool, job_id=JOB, lease_owner=LEASE, results=[raw])

    spec = JobSpec(
        job_id=JOB,
        inputs=["rows.jsonl"],
        messages=[ChatMessage(role="user", content="{{ n }}")],
        model="m",
        output_uri="file:///tmp/out",
    )
    shard = ShardInput(
        spec=spec,
        layout=JobLayout(
            job_id=JOB, output_root="file:///tmp/out/nul-job", input_format=InputFormat.JSONL
        ),
        shard=0,
        gpu_task_queue="q",
    )
    todo = [StagedRequest(item_id="row-0", source="rows:1", messages=[])]
    recorder = Recorder(
        ActivityContext(settings=Settings(), pool=ledger_pool),
        shard,
        LEASE,
        GenerateProgress(),
        todo,
    )
    recorder.add(
        GenerationResult(
            request_id=f"{LEASE}:0", text="a\x00b", parsed={"k\x00": ["\x00"]}, finish_reason="stop"
        )
    )
    await recorder.flush()

    (row,) = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    assert row.status == "succeeded"
    assert row.result == {
        "text": "a\ufffdb",
        "parsed": {"k\ufffd": ["\ufffd"]},
        "finish_reason": "stop",
    }
