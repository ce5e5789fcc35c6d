"""Entry point of the ``llm-batch`` console script: one Typer app, one module per group."""

from __future__ import annotations

from typing import Any

import typer

from llmbatch.cli import (
    api,
    cache,
    codec,
    control,
    demo,
    dev,
    dlq,
    docs,
    endpoints,
    jobs,
    migrate,
    purge,
    queues,
    schedules,
    worker,
)
from llmbatch.cli.common import leave_if_client_command
from llmbatch.engine import parent_death

# A multiprocessing child spawned by an engine of this process imports this module as
# its __mp_main__: it is marked to die with its parent (see llmbatch.engine.parent_death).
parent_death.on_main_import(__name__)


class _App(typer.Typer):
    """The console script's app: client commands end without interpreter teardown
    (see :func:`leave_if_client_command`). Test runners invoke the click command, not
    this, so they are unaffected."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as exc:
            leave_if_client_command(exc.code)
            raise


app = _App(
    name="llm-batch",
    help="Durable LLM batch inference on Temporal.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(
    dev.app, name="dev", help="The embedded stack: Temporal, Postgres, S3 on this machine."
)
app.add_typer(worker.app, name="worker", help="Run a CPU, GPU or remote worker.")
app.add_typer(schedules.app, name="schedule", help="Recurring jobs on Temporal Schedules.")
app.add_typer(dlq.app, name="dlq", help="A job's dead items: list them, re-drive them.")
app.add_typer(
    endpoints.app, name="endpoint", help="Remote OpenAI-compatible endpoints and their limits."
)
app.add_typer(cache.app, name="cache", help="The result cache across jobs: stats, purge.")
app.command("migrate")(migrate.migrate_command)
app.command("purge")(purge.purge)
app.command("demo")(demo.demo)
app.command("queues")(queues.queues)
app.command("codec-server")(codec.codec_server)
app.add_typer(codec.keys_app, name="codec-key", help="Payload encryption keys: rotate them.")
app.add_typer(docs.app, name="docs", help="The docs site's generated reference pages.")
jobs.register(app)
control.register(app)
api.register(app)


if __name__ == "__main__":
    app()
