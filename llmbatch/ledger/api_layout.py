"""Ids of the OpenAI Batch API's objects and where their bytes live (the keys beside
the records of :mod:`llmbatch.ledger.api_records`): declared once for the HTTP server
and for the activities that register a finished batch's output files."""

from __future__ import annotations

import secrets

# Everything the API stores goes under this prefix of the configured bucket.
API_PREFIX = "api"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    # Also the job id and workflow id: it must match JobSpec's job id pattern.
    return f"batch_{secrets.token_hex(12)}"


def file_uri(bucket: str, file_id: str) -> str:
    """The object holding a file's bytes. Built from the file id only: nothing a
    caller sends names a location."""
    return f"s3://{bucket}/{API_PREFIX}/files/{file_id}"


def batch_output_uri(bucket: str) -> str:
    """A batch job's ``output_uri`` (its parts go under ``<this>/<batch id>/``)."""
    return f"s3://{bucket}/{API_PREFIX}/batches"
