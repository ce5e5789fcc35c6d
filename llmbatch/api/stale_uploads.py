"""Aborting the S3 multipart uploads of ``POST /v1/files`` that nothing will finish.

An upload streams into an S3 multipart upload (llmbatch.api.upload); a server killed
mid-upload leaves it open, its parts held (and billed) by the object store for ever.
Every ``llm-batch serve`` replica sweeps the API's file prefix at start and then
every :data:`SWEEP_EVERY`, aborting the uploads begun more than
``Settings.api_stale_upload_after`` ago (far longer than any live upload takes).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from llmbatch.ledger import api_layout

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

SWEEP_EVERY = timedelta(minutes=10)


def abort_stale_uploads(client: S3Client, *, bucket: str, older_than: timedelta) -> int:
    """Abort the multipart uploads under the API's files prefix begun more than
    ``older_than`` ago; return how many."""
    cutoff = datetime.now(UTC) - older_than
    aborted = 0
    pages = client.get_paginator("list_multipart_uploads").paginate(
        Bucket=bucket, Prefix=f"{api_layout.API_PREFIX}/files/"
    )
    for page in pages:
        for upload in page.get("Uploads", []):
            if upload["Initiated"] > cutoff:
                continue
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
            aborted += 1
    return aborted


async def sweep_forever(client: S3Client, *, bucket: str, older_than: timedelta) -> None:
    """:func:`abort_stale_uploads` now and every :data:`SWEEP_EVERY` (or sooner when
    ``older_than`` is shorter), until cancelled; a failed sweep waits for the next."""
    every = min(SWEEP_EVERY, older_than).total_seconds()
    while True:
        try:
            aborted = await asyncio.to_thread(
                abort_stale_uploads, client, bucket=bucket, older_than=older_than
            )
        except Exception as exc:  # the object store away: the next sweep tries again
            log.warning("stale multipart uploads not swept: %s", exc)
        else:
            if aborted:
                log.info("aborted %d stale multipart uploads", aborted)
        await asyncio.sleep(every)
