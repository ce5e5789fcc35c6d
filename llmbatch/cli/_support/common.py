"""What every CLI command shares: consoles, one-line errors, JSON output, job lookup.

Command modules share code through this package (:mod:`llmbatch.cli._support`), never
by importing each other.

Errors, one idiom for every command: a command's own (synchronous) code ends with
``raise fail("what went wrong")``; code it runs under :func:`run` raises
:class:`CliError`, which ``run`` hands to ``fail``. Either way the user gets one
line on stderr, ``error: ...``, and exit code 1.

Imported whenever the CLI starts, so Temporal, the settings and the contract's models
are imported by the functions that use them, not here.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from llmbatch.errors import LlmBatchError

if TYPE_CHECKING:
    from temporalio.client import Client, WorkflowExecutionDescription, WorkflowHandle

    from llmbatch.config import Settings
    from llmbatch.contract.messages import JobSummary

# soft_wrap: URIs and links stay whole (and clickable) whatever the terminal width.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

# The parameters many commands take, declared once so their help reads the same everywhere.
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
JobIdArgument = Annotated[str, typer.Argument(help="The job id (its workflow id).")]
# Seconds between progress lines when stdout is not a terminal (``watch --interval``).
DEFAULT_LINE_INTERVAL_S = 10.0


class CliError(LlmBatchError):
    """A command's failure, raised under :func:`run`: one line on stderr, exit code 1."""


def emit_json(data: Any) -> None:
    """Machine output: plain JSON on stdout, whatever the terminal."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def emit_json_line(data: Any) -> None:
    """One JSON document on one line (a stream of them is JSON Lines), flushed at once."""
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str) -> typer.Exit:
    """Print ``message`` as one error line on stderr; raise the returned Exit (code 1).

    The only place an error is printed, so every command's errors look alike.
    """
    # One line whatever the message holds: a multi-line cause would break scripts
    # that read the first line of stderr.
    line = " ".join(message.split())
    err.print(f"[red]error:[/red] {escape(line)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


class _ClientCommand:
    """Set once a command has run a Temporal client (see :func:`leave_if_client_command`)."""

    ran = False


def runs_temporal_client() -> None:
    """Mark this command as one that runs a Temporal client: it ends as
    :func:`leave_if_client_command` says. :func:`run` marks the commands it runs;
    a worker's command marks itself."""
    _ClientCommand.ran = True


def run(coro: Any) -> Any:
    """Run a command's coroutine; turn known failures into one clear line."""
    import asyncio

    from temporalio.service import RPCError

    from llmbatch.client.temporal import TemporalUnavailable

    runs_temporal_client()
    try:
        return asyncio.run(coro)
    except (CliError, TemporalUnavailable) as exc:
        raise fail(str(exc)) from None
    except RPCError as exc:
        # The server answered, but not as expected (unavailable, permission, ...).
        raise fail(f"Temporal refused the call: {exc.message or exc}") from None


_AGE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

T = TypeVar("T")


def parse_age(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s`` as a duration (``--older-than``)."""
    match = _AGE.match(text)
    if match is None:
        raise ValueError(f"--older-than {text!r} is not an age like 30d, 12h, 90m, 2w")
    return timedelta(seconds=int(match[1]) * _UNIT_S[match[2]])


async def with_pool(settings: Settings, use: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``use`` with a small ledger pool (commands that read or write Postgres)."""
    from llmbatch import ledger

    try:
        pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value(), max_size=2)
    except OSError as exc:
        raise CliError(f"cannot reach Postgres: {exc}") from None
    try:
        return await use(pool)
    finally:
        await pool.close()


def job_url(settings: Settings, job_id: str) -> str:
    """The job's page in the Temporal Web UI."""
    return f"{settings.web_ui_url}/namespaces/{settings.temporal_namespace}/workflows/{job_id}"


def failure_message(exc: BaseException) -> str:
    """The innermost message of a failure chain: what actually went wrong."""
    cause: BaseException | None = exc
    message = str(exc)
    while cause is not None:
        message = str(cause) or message
        cause = cause.__cause__ or getattr(cause, "cause", None)
    return message


async def find_job(
    client: Client, settings: Settings, job_id: str
) -> tuple[WorkflowHandle[Any, JobSummary], WorkflowExecutionDescription]:
    """The job's handle (latest run) and description; CliError when there is no such job."""
    from temporalio.service import RPCError, RPCStatusCode

    from llmbatch.contract.messages import JobSummary

    handle = client.get_workflow_handle(job_id, result_type=JobSummary)
    try:
        description = await handle.describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise CliError(
                f"no job {job_id!r} in namespace {settings.temporal_namespace}"
            ) from None
        raise
    return handle, description


def leave_if_client_command(code: object) -> None:
    """End a short-lived client command's process without interpreter teardown.

    Temporal's Rust runtime keeps threads that can call into Python while the
    interpreter finalizes, which sometimes aborts the process ("Fatal Python error:
    PyGILState_Release", temporalio/sdk-python#300) after the command has done its
    work. So once the command is done: flush the output, run the exit handlers
    (telemetry flushes its spans there), and exit with the command's code at once.
    Workers end this way too, once their own shutdown is done (a drain, the engine's
    shutdown and its processes killed): a worker refused at startup aborted so in CI,
    where its exit code is what a supervisor reads. The dev stack and the demo, which
    run no client of their own to the end, end normally.
    """
    if not _ClientCommand.ran:
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): Python prints it and exits with 1
        print(code, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(status)
