"""What a worker checks before it polls: Temporal, Postgres and the object store.

A worker that polls with a bad DSN or a wrong S3 endpoint takes tasks and fails each
of them, over and over, far from the cause. So both workers check every service
they need first, cheapest first (the GPU worker before it loads its engine), and
stop on the first that fails with :class:`StartupCheckFailed`: one line naming the
service and where it is, never a password, which the CLI prints as its error.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
from botocore.exceptions import BotoCoreError, ClientError
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from llmbatch import storage
from llmbatch.client.temporal import TemporalUnavailable, connect_to, connection
from llmbatch.config import Settings, redact
from llmbatch.errors import LlmBatchError
from llmbatch.ledger.migrate import MigrationError, load_migrations
from llmbatch.security.connection import explain_connect_error
from llmbatch.workers.shutdown import one_line

# Each check gives up after this long: a service that does not answer within it is
# as good as absent for a worker that is starting. A refused connection fails at
# once; this bounds only a service that is slow to answer. 5 s was too short for a
# Postgres that was there but busy (a loaded 2-core CI machine, a remote worker's
# check beside a vLLM server starting): the worker refused to start.
CHECK_TIMEOUT_S = 15.0
_NO_BUCKET_CODES = {"404", "NoSuchBucket", "NotFound"}
_BAD_CREDENTIALS_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


class StartupCheckFailed(LlmBatchError, RuntimeError):
    """A service a worker needs is unreachable or misconfigured; the message is one
    line naming it and where it is, with no secret in it."""


async def check_services(settings: Settings) -> Client:
    """Check Temporal, Postgres and the object store; return the Temporal client.

    Raises :class:`StartupCheckFailed` for the first service that fails.
    """
    client = await check_temporal(settings)
    await check_postgres(settings)
    await check_object_store(settings)
    return client


def check_now(settings: Settings) -> None:
    """:func:`check_services` from synchronous code: the GPU worker's command runs it
    before it imports vLLM to parse the engine arguments, which takes seconds to tens
    of seconds, so a bad setting fails at once."""
    asyncio.run(check_services(settings))


async def check_temporal(settings: Settings) -> Client:
    """Connect, and make sure the namespace exists (a worker on a missing one would
    only fail at its first poll). A refused handshake, an expired certificate or a
    wrong API key is one line naming the cause (llmbatch.security.connection)."""
    try:
        target, keyring = connection(settings)
    except TemporalUnavailable as exc:
        raise StartupCheckFailed(one_line(exc)) from None
    where = target.describe()
    try:
        client = await asyncio.wait_for(connect_to(target, keyring=keyring), CHECK_TIMEOUT_S)
    except TemporalUnavailable as exc:
        raise StartupCheckFailed(one_line(exc)) from None
    except TimeoutError:
        raise StartupCheckFailed(
            f"cannot reach {where}: no answer within {CHECK_TIMEOUT_S:.0f} s"
        ) from None
    try:
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=target.namespace),
            timeout=timedelta(seconds=CHECK_TIMEOUT_S),
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise StartupCheckFailed(
                f"{where} has no namespace {target.namespace!r} "
                "(LLMBATCH_TEMPORAL_NAMESPACE or TEMPORAL_NAMESPACE)"
            ) from None
        if exc.status in (RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.PERMISSION_DENIED):
            raise StartupCheckFailed(explain_connect_error(exc, target)) from None
        raise StartupCheckFailed(f"{where} refused: {one_line(exc)}") from None
    return client


async def check_postgres(settings: Settings) -> None:
    """Connect, run a query, and check that every migration llm-batch has is applied."""
    dsn = settings.postgres_dsn.get_secret_value()
    where = f"Postgres at {redact(dsn)}"
    try:
        expected = len(load_migrations(settings.migrations_dir))
    except MigrationError as exc:
        raise StartupCheckFailed(f"cannot check {where}: {one_line(exc)}") from None
    try:
        conn = await asyncpg.connect(dsn, timeout=CHECK_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        # Refused, timed out, no such host or socket: the server is not there.
        raise StartupCheckFailed(f"cannot reach {where}: {one_line(exc)}") from None
    except asyncpg.PostgresError as exc:
        # Reached, but refused: authentication, no such database, permissions.
        raise StartupCheckFailed(
            f"{where} refused: {type(exc).__name__}: {one_line(exc)}"
        ) from None
    except (asyncpg.InterfaceError, ValueError):
        # The driver's message may quote the DSN, password and all: not shown.
        raise StartupCheckFailed(
            f"cannot use the Postgres DSN {redact(dsn)} (LLMBATCH_POSTGRES_DSN)"
        ) from None
    try:
        applied = await conn.fetchval(
            "SELECT coalesce(max(version), 0) FROM schema_migrations", timeout=CHECK_TIMEOUT_S
        )
    except asyncpg.UndefinedTableError:
        applied = 0
    except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
        raise StartupCheckFailed(f"{where} failed a query: {one_line(exc)}") from None
    finally:
        await conn.close()
    if applied < expected:
        raise StartupCheckFailed(
            f"{where} has {applied} of llm-batch's {expected} migrations applied; "
            "apply them with: llm-batch migrate"
        )
    if applied > expected:
        raise StartupCheckFailed(
            f"{where} has {applied} migrations applied, this llm-batch knows {expected}: "
            "is this worker older than the database?"
        )


async def check_object_store(settings: Settings) -> None:
    """Reach the S3 endpoint with the configured credentials and find the bucket."""
    endpoint = redact(settings.s3_endpoint_url) if settings.s3_endpoint_url else "AWS S3"
    bucket = settings.s3_bucket
    client = storage.s3.s3_client(settings, max_attempts=1, timeout_s=CHECK_TIMEOUT_S)
    try:
        await asyncio.to_thread(client.head_bucket, Bucket=bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _NO_BUCKET_CODES:
            raise StartupCheckFailed(
                f"S3 at {endpoint} has no bucket {bucket!r} (LLMBATCH_S3_BUCKET)"
            ) from None
        if code in _BAD_CREDENTIALS_CODES:
            raise StartupCheckFailed(
                f"S3 at {endpoint} refused the credentials for bucket {bucket!r} ({code}); "
                "check LLMBATCH_S3_ACCESS_KEY_ID and LLMBATCH_S3_SECRET_ACCESS_KEY"
            ) from None
        raise StartupCheckFailed(f"S3 at {endpoint} refused: {code or one_line(exc)}") from None
    except BotoCoreError as exc:
        # Connection refused or timed out, a bad endpoint URL: nothing answered.
        raise StartupCheckFailed(f"cannot reach S3 at {endpoint}: {one_line(exc)}") from None
    finally:
        client.close()
