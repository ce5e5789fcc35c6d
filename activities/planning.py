"""plan_job and finalize_job: the first and last steps of a job."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmbatch import ledger, storage
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import (
    FinalizeInput,
    JobEndInput,
    JobLayout,
    JobSummary,
    PlanResult,
    TokenCounts,
    final_state,
)
from llmbatch.contract.names import FINALIZE_JOB, PLAN_JOB, RECORD_JOB_END
from llmbatch.contract.spec import InputFormat, JobSpec, Task
from llmbatch.contract.states import BatchStatus, FailureType
from llmbatch.dedup import leads
from llmbatch.formats import ShardPlan, openai_validation, planning
from llmbatch.ledger import api_records
from llmbatch.tables import jobs as tables


class _BatchInvalid(planning.InvalidJobSpec):
    """An API batch's lines failed validation (its errors are recorded already)."""


class PlanningActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=PLAN_JOB)
    async def plan_job(self, spec: JobSpec) -> PlanResult:
        """Check the job, split its inputs into shards and stage one plan per shard.

        Plans go to storage, not into the result: a job of a million rows has
        thousands of shards, far more than a Temporal payload may carry.
        """
        try:
            if spec.api_batch is not None:
                await self._validate_api_batch(spec)
            input_format, shards = await self._plan(spec)
        except _BatchInvalid as exc:
            raise ApplicationError(
                str(exc), type=FailureType.INVALID_JOB_SPEC, non_retryable=True
            ) from exc
        except planning.InvalidJobSpec as exc:
            if spec.api_batch is not None:
                await self._fail_api_batch(spec, [_batch_error(exc)])
            raise ApplicationError(
                str(exc), type=FailureType.INVALID_JOB_SPEC, non_retryable=True
            ) from exc
        layout = JobLayout(
            job_id=spec.job_id,
            output_root=tables.work_root(spec, self._ctx.settings),
            input_format=input_format,
        )
        for shard in shards:
            await self._ctx.write(layout.shard_plan(shard.index), shard.model_dump_json().encode())
            activity.heartbeat(shard.index)
        await ledger.jobs.record_shards(
            self._ctx.pool,
            job_id=spec.job_id,
            shards=[
                ledger.jobs.PlannedShard(s.index, s.uri, s.first_row, s.row_count, s.first_line)
                for s in shards
            ],
        )
        await ledger.jobs.upsert_job(
            self._ctx.pool,
            job_id=spec.job_id,
            spec=spec.model_dump(mode="json"),
            model=spec.model,
            output_uri=layout.output_root,
        )
        if spec.api_batch is not None:
            # Every line is valid and the plan is stored: the batch runs.
            await api_records.set_batch_status(
                self._ctx.pool, batch_id=spec.job_id, status=BatchStatus.IN_PROGRESS
            )
        return PlanResult(
            layout=layout,
            shard_count=len(shards),
            items_total=sum(s.row_count for s in shards),
            gpu_task_queue=self._ctx.settings.gpu_task_queue(
                spec.model, spec.task, endpoint=spec.remote_endpoint
            ),
            generate_schedule_to_start=self._ctx.settings.generate_schedule_to_start,
            priority_aging=self._ctx.settings.priority_aging or None,
            progress_every=self._ctx.settings.progress_every or None,
        )

    async def _plan(self, spec: JobSpec) -> tuple[InputFormat, list[ShardPlan]]:
        """The job's input format and shards; a table output is checked or created."""
        settings = self._ctx.settings
        if spec.table_input:
            shards = await tables.check_table_job(
                spec, settings, settings.render_limits, create_output=True
            )
            return InputFormat.TABLE, shards or []
        info = await asyncio.to_thread(
            planning.inspect_inputs, spec, self._ctx.store, settings.render_limits
        )
        shards = await asyncio.to_thread(planning.plan, spec, info, self._ctx.store)
        if spec.table_output:
            await tables.check_table_job(spec, settings, settings.render_limits, create_output=True)
        return info.input_format, shards

    async def _validate_api_batch(self, spec: JobSpec) -> None:
        """Check every line of an OpenAI Batch API batch before anything runs; on any
        error the batch is ``failed`` with its errors (line, code, message, param)."""
        errors = await asyncio.to_thread(
            planning.validate_api_batch,
            spec,
            self._ctx.store,
            max_requests=self._ctx.settings.api_max_requests_per_batch,
        )
        if not errors:
            return
        await self._fail_api_batch(spec, errors)
        shown = "; ".join(
            (f"line {e.line}: " if e.line is not None else "") + f"{e.code}: {e.message}"
            for e in errors[:3]
        )
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise _BatchInvalid(f"the batch input file is invalid: {shown}{more}")

    async def _fail_api_batch(
        self, spec: JobSpec, errors: list[openai_validation.BatchError]
    ) -> None:
        await api_records.set_batch_status(
            self._ctx.pool,
            batch_id=spec.job_id,
            status=BatchStatus.FAILED,
            errors=[e.as_json() for e in errors],
        )

    @activity.defn(name=FINALIZE_JOB)
    async def finalize_job(self, input: FinalizeInput) -> JobSummary:
        """Write the manifest next to the output, record the outcome, drop staging.

        Counts come from the ledger, the source of truth, not from the shards' reports:
        a dead-letter re-drive finalizes again and the numbers follow.
        """
        summary = input.summary.model_copy()
        layout = input.layout
        counts = await ledger.jobs.job_counts(self._ctx.pool, job_id=summary.job_id)
        summary.items_succeeded, summary.items_dead = counts.succeeded, counts.dead
        summary.tokens = TokenCounts(
            prompt=counts.prompt_tokens, completion=counts.completion_tokens
        )
        summary.usage = await ledger.usage.usage(self._ctx.pool, job_id=summary.job_id)
        summary.state = final_state(summary)
        if summary.started_at and summary.finished_at:
            started = datetime.fromisoformat(summary.started_at)
            summary.elapsed_s = (
                datetime.fromisoformat(summary.finished_at) - started
            ).total_seconds()
        summary.manifest = layout.manifest
        store = self._ctx.store(layout.output_root)
        try:
            objects = await asyncio.to_thread(store.list, f"{layout.output_root}/")
        except storage.base.InputNotFound:
            # No output part at all (no shard wrote one): an empty list, not a fault
            # to retry for minutes.
            objects = []
        parts = sorted(o.uri for o in objects if "/part-" in o.uri and "/_staging/" not in o.uri)
        manifest = {
            "job_id": summary.job_id,
            "model": summary.model,
            "state": summary.state,
            "items": {
                "total": summary.items_total,
                "succeeded": summary.items_succeeded,
                "dead": summary.items_dead,
            },
            "tokens": summary.tokens.model_dump(),
            "usage": _usage(summary),
            "shards": summary.shards_total,
            "failed_shards": summary.failed_shards,
            "input_format": layout.input_format.value,
            "output_parts": [p for p in parts if "/errors/" not in p],
            "error_parts": [p for p in parts if "/errors/" in p],
            "started_at": summary.started_at,
            "finished_at": summary.finished_at,
            "elapsed_s": summary.elapsed_s,
            "spec": input.spec.model_dump(mode="json"),
        }
        if input.spec.table_output:
            manifest["output_table"] = input.spec.output_uri
        if input.spec.task is Task.EMBED:
            vectors = await ledger.jobs.embedding_counts(self._ctx.pool, job_id=summary.job_id)
            manifest["task"] = input.spec.task.value
            manifest["embeddings"] = {"count": vectors.count, "dimensions": vectors.dimensions}
        await self._ctx.write(layout.manifest, json.dumps(manifest, indent=2).encode())
        await ledger.jobs.finish_job(
            self._ctx.pool,
            job_id=summary.job_id,
            status=summary.state,
            items_total=summary.items_total,
            items_succeeded=summary.items_succeeded,
            items_dead=summary.items_dead,
            prompt_tokens=summary.tokens.prompt,
            completion_tokens=summary.tokens.completion,
        )
        await leads.forget_leads(self._ctx.pool, job_id=summary.job_id)
        await asyncio.to_thread(store.delete_prefix, layout.staging + "/")
        return summary

    @activity.defn(name=RECORD_JOB_END)
    async def record_job_end(self, input: JobEndInput) -> None:
        """Record the end state of a job that was cancelled or failed (finalize_job
        records the others), with the counts the ledger has so far.

        Items not done stay ``pending``: nothing of them is lost, only never run. A
        job with no ledger row yet (it ended while planning) is left without one.
        """
        counts = await ledger.jobs.job_counts(self._ctx.pool, job_id=input.job_id)
        await ledger.jobs.finish_job(
            self._ctx.pool,
            job_id=input.job_id,
            status=input.state,
            items_total=input.items_total,
            items_succeeded=counts.succeeded,
            items_dead=counts.dead,
            prompt_tokens=counts.prompt_tokens,
            completion_tokens=counts.completion_tokens,
        )


def _usage(summary: JobSummary) -> dict[str, Any]:
    """The manifest's usage: sources, GPU time and cost, and on a remote endpoint what
    the job's requests did there, whether it was rate- or engine-bound, and its cost
    per item."""
    usage = summary.usage
    shown = {
        **usage.model_dump(mode="json"),
        "gpu_seconds_saved": usage.gpu_seconds_saved,
        "cost_per_1000_items": usage.cost_per_1000(summary.items_done),
    }
    if usage.remote is not None:
        shown["remote"].update(
            bound=usage.remote.bound,
            rate_wait_share=usage.remote.rate_share,
            cost_per_item_usd=usage.remote.per_item(summary.items_done),
        )
    return shown


# An object URI in a message: what the caller of an API batch must not see (the
# server's bucket and layout), and cannot use.
_OBJECT_URI = re.compile(r"\b(?:s3|file)://\S+?(?=[:\s,;)]|$)")


def _batch_error(exc: planning.InvalidJobSpec) -> openai_validation.BatchError:
    """A refused API batch's ``errors.data`` entry, with no internal object URI (a
    line's own faults are that line's 400, never the batch's)."""
    return openai_validation.BatchError(
        code=openai_validation.INVALID_REQUEST, message=_OBJECT_URI.sub("the input file", str(exc))
    )
