"""record_api_batch, set_api_batch_status and finish_api_batch: an OpenAI Batch API
batch's record, its status, and its end as one output file and one error file
registered as API files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmbatch import formats, ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import (
    ApiBatchEndInput,
    ApiBatchFiles,
    ApiBatchRecordInput,
    ApiBatchStatusInput,
    TokenCounts,
)
from llmbatch.contract.names import FINISH_API_BATCH, RECORD_API_BATCH, SET_API_BATCH_STATUS
from llmbatch.contract.spec import ApiEndpoint, JobSpec
from llmbatch.contract.states import BatchStatus, ErrorClass, FailureType
from llmbatch.formats import openai_output, openai_requests
from llmbatch.formats.vectors import read_vectors
from llmbatch.ledger import api_layout, api_records
from llmbatch.stages import encode

# Custom ids looked up in the ledger per query while the files are assembled: memory
# stays bounded by this, whatever the batch's size.
LOOKUP_BATCH = 1000

# The error class of the requests a batch did not finish, by how the batch ended.
_UNFINISHED: dict[BatchStatus, ErrorClass] = {
    BatchStatus.EXPIRED: ErrorClass.BATCH_EXPIRED,
    BatchStatus.CANCELLED: ErrorClass.BATCH_CANCELLED,
}


class ApiBatchActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=RECORD_API_BATCH)
    async def record_api_batch(self, input: ApiBatchRecordInput) -> None:
        """Write the batch's record (``validating``), once; refused for good
        (``TooManyBatches``) when its project has its limit of unfinished batches."""
        try:
            await api_records.insert_batch(
                self._ctx.pool,
                batch_id=input.batch_id,
                project=input.project,
                input_file_id=input.input_file_id,
                endpoint=input.endpoint,
                completion_window=input.completion_window,
                window=timedelta(seconds=input.window_s),
                model=input.model,
                metadata=input.metadata,
                max_in_progress=input.max_in_progress,
            )
        except api_records.TooManyBatches:
            raise ApplicationError(
                f"project has {input.max_in_progress} batches in progress",
                type=FailureType.TOO_MANY_BATCHES,
                non_retryable=True,
            ) from None

    @activity.defn(name=SET_API_BATCH_STATUS)
    async def set_api_batch_status(self, input: ApiBatchStatusInput) -> bool:
        """Move the batch to ``input.status`` (fenced: a final status stays)."""
        return await api_records.set_batch_status(
            self._ctx.pool, batch_id=input.batch_id, status=input.status
        )

    @activity.defn(name=FINISH_API_BATCH)
    async def finish_api_batch(self, input: ApiBatchEndInput) -> ApiBatchFiles:
        """End the batch: requests not finished stop for good (dead, as expired or
        cancelled, so a late result cannot land after the files are made), the output
        and error files are assembled in input order and registered, and the batch
        takes its final status.

        The files are built by streaming the input file (every custom_id, in order)
        against the ledger, a thousand ids at a time, into local temporary files that
        are then uploaded (multipart when large): never whole in memory.
        """
        spec, pool = input.spec, self._ctx.pool
        batch = spec.api_batch
        assert batch is not None  # the workflow calls this for API batches only
        job_id = spec.job_id
        if await api_records.batch_status(pool, batch_id=job_id) in api_records.FINAL_STATUSES:
            return await self._counts(job_id)  # a retry of a call that got through
        error_class = _UNFINISHED.get(input.status)
        if error_class is not None:
            _, message = openai_output.NEVER_RAN[error_class]
            for shard in await ledger.jobs.planned_shards(pool, job_id=job_id):
                # Also stands in for the rows of shards that never started, so the
                # job's counts hold every request.
                await ledger.dead_letters.dead_letter_shard(
                    pool, job_id=job_id, shard=shard, error_class=error_class, error_message=message
                )
                activity.heartbeat(shard)
        with (
            tempfile.NamedTemporaryFile(prefix="llm-batch-output-", suffix=".jsonl") as out,
            tempfile.NamedTemporaryFile(prefix="llm-batch-error-", suffix=".jsonl") as err,
        ):
            files = await self._assemble(input, out, err)
            bucket = self._ctx.settings.s3_bucket
            output_file = await self._upload(bucket, out) if files.succeeded else None
            error_file = await self._upload(bucket, err) if files.failed else None
        async with pool.acquire() as conn, conn.transaction():
            for kind, uploaded in (("output", output_file), ("error", error_file)):
                if uploaded is not None:
                    file_id, uri, size = uploaded
                    await api_records.register_output_file(
                        conn,
                        file_id=file_id,
                        project=batch.project,
                        filename=f"{job_id}_{kind}.jsonl",
                        size=size,
                        object_uri=uri,
                    )
            files.output_file_id = output_file[0] if output_file else None
            files.error_file_id = error_file[0] if error_file else None
            await api_records.attach_files(
                conn,
                batch_id=job_id,
                output_file_id=files.output_file_id,
                error_file_id=files.error_file_id,
            )
            await api_records.set_batch_status(conn, batch_id=job_id, status=input.status)
        return files

    async def _assemble(
        self, input: ApiBatchEndInput, out: IO[bytes], err: IO[bytes]
    ) -> ApiBatchFiles:
        """Write one line per request to ``out`` (succeeded) or ``err`` (the rest), in
        the input's order."""
        spec = input.spec
        writer = encode.OpenAIWriter(spec)
        # A request without a finished row did not run: named as the batch ended.
        unfinished = _UNFINISHED.get(input.status, ErrorClass.BATCH_CANCELLED)
        files = ApiBatchFiles()
        ids = _custom_ids(self._ctx, spec)
        try:
            while True:
                chunk = await asyncio.to_thread(_take, ids, LOOKUP_BATCH)
                if not chunk:
                    break
                rows = await ledger.items.items_by_id(
                    self._ctx.pool, job_id=spec.job_id, item_ids=[r.custom_id for r in chunk]
                )
                # An embeddings batch's vectors are staged objects: this chunk's only.
                vectors = await read_vectors(self._ctx.read, rows.values())
                lines_out: list[dict[str, Any]] = []
                lines_err: list[dict[str, Any]] = []
                for request in chunk:
                    custom_id = request.custom_id
                    line, ok = writer.line(
                        custom_id,
                        rows.get(custom_id),
                        vectors=vectors.get(custom_id),
                        encoding=request.encoding,
                        unfinished=unfinished,
                    )
                    (lines_out if ok else lines_err).append(line)
                    if ok:
                        row = rows[custom_id]
                        files.tokens = files.tokens + TokenCounts(
                            prompt=row.prompt_tokens or 0, completion=row.completion_tokens or 0
                        )
                files.succeeded += len(lines_out)
                files.failed += len(lines_err)
                await asyncio.to_thread(out.write, encode.api_file_lines(lines_out))
                await asyncio.to_thread(err.write, encode.api_file_lines(lines_err))
                activity.heartbeat(files.succeeded + files.failed)
        finally:
            ids.close()
        return files

    async def _upload(self, bucket: str, f: IO[bytes]) -> tuple[str, str, int]:
        """Store a finished file as a new API file: (file id, object URI, bytes)."""
        f.flush()
        file_id = api_layout.new_file_id()
        uri = api_layout.file_uri(bucket, file_id)
        store = self._ctx.store(uri)
        await asyncio.to_thread(store.put_file, uri, Path(f.name))
        return file_id, uri, f.tell()

    async def _counts(self, job_id: str) -> ApiBatchFiles:
        counts = await ledger.jobs.job_counts(self._ctx.pool, job_id=job_id)
        return ApiBatchFiles(
            succeeded=counts.succeeded,
            failed=counts.total - counts.succeeded,
            tokens=counts.tokens,
        )


@dataclass(frozen=True)
class _Request:
    """What the files need of an input line besides the ledger: its custom_id and, for
    /v1/embeddings, the encoding its vectors are written in."""

    custom_id: str
    encoding: str = "float"


def _custom_ids(ctx: ActivityContext, spec: JobSpec) -> Generator[_Request, None, None]:
    """Every request of the batch's input, in order (the input passed validation)."""
    embeddings = spec.endpoint is ApiEndpoint.EMBEDDINGS
    for uri in spec.inputs:
        for obj in ctx.store(uri).list(uri):
            lines = formats.iter_lines(ctx.store(obj.uri), obj.uri, max_bytes=spec.max_row_bytes)
            with contextlib.closing(lines):
                for _, data in lines:
                    if data is None:
                        raise ValueError(f"{obj.uri}: a line is longer than the validated limit")
                    line = json.loads(data)
                    encoding = "float"
                    if embeddings:
                        # A line whose format is bad died at render: it gets an error line.
                        with contextlib.suppress(openai_requests.InvalidRequest):
                            encoding = openai_requests.encoding_format(line["body"])
                    yield _Request(str(line["custom_id"]), encoding)


def _take(ids: Iterator[_Request], n: int) -> list[_Request]:
    chunk: list[_Request] = []
    for request in ids:
        chunk.append(request)
        if len(chunk) == n:
            break
    return chunk
