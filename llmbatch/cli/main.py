"""Entry point of the ``llm-batch`` console script: one Typer app, one module per group."""

from __future__ import annotations

import typer

from llmbatch.cli import demo, dev, jobs, migrate, schedules, worker

app = typer.Typer(
    name="llm-batch",
    help="Durable LLM batch inference on Temporal.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(
    dev.app, name="dev", help="The embedded stack: Temporal, Postgres, S3 on this machine."
)
app.add_typer(worker.app, name="worker", help="Run a CPU or GPU worker.")
app.add_typer(schedules.app, name="schedule", help="Recurring jobs on Temporal Schedules.")
app.command("migrate")(migrate.migrate_command)
app.command("demo")(demo.demo)
jobs.register(app)


if __name__ == "__main__":
    app()
