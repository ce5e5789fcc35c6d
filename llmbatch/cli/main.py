"""Entry point of the ``llm-batch`` console script: one Typer app, one module per group.

Every command module declares a Typer ``app``: a group's is named (``dlq``,
``schedule``, ...), while the commands of one that is not named (``jobs``: ``submit``,
``status``, ...) join the top level. Each is added here the same way, in the order
``--help`` lists them.
"""

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
from llmbatch.cli._support.common import leave_if_client_command
from llmbatch.engine import parent_death

# A process an engine of this CLI spawns re-runs the CLI's main module, the console
# script or this module run with -m, and comes here either way: it marks itself to die
# with its parent now, before its imports of vLLM and torch (see
# llmbatch.engine.parent_death; vLLM's plugin hook marks it later whatever the entry).
# Anywhere else this is one environment lookup; the module imports nothing until it acts.
parent_death.mark_if_started_by_us()


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
for module in (
    jobs,
    control,
    dlq,
    schedules,
    demo,
    dev,
    worker,
    queues,
    endpoints,
    cache,
    purge,
    migrate,
    api,
    codec,
    docs,
):
    app.add_typer(module.app)


if __name__ == "__main__":
    app()
