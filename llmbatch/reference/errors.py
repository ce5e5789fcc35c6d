"""The error reference: :class:`ErrorClass`, :class:`FailureType` and
:class:`EndpointFault`, with the cause and remedy declared beside them in
:mod:`llmbatch.contract.explanations`."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from llmbatch.contract.explanations import (
    ENDPOINT_FAULT_HELP,
    ERROR_CLASS_HELP,
    FAILURE_TYPE_HELP,
    Explanation,
)
from llmbatch.contract.states import EndpointFault, ErrorClass, FailureType
from llmbatch.reference.markdown import code, page, table


def render() -> str:
    return page(
        "Error classes",
        "Three vocabularies. An item that can never succeed is *dead* with an error class: "
        "it stays in the ledger, in the job's dead-letter list (`llm-batch dlq list JOB`) "
        "and in the output with its error, and `llm-batch dlq redrive JOB --class NAME` "
        "runs it again. A step or request that llm-batch refuses fails with a failure type "
        "(a Temporal `ApplicationError` type, which retry policies treat as final); the CLI "
        "shows its message in one line. A request to a remote endpoint that fails by the "
        "endpoint's doing has an endpoint fault. See [Dead letters](../concepts/dead-letters.md) "
        "and the [failure model](../operations/failure-model.md).",
        [
            "## Error classes of dead items\n\n" + _table(ErrorClass, ERROR_CLASS_HELP),
            "## Failure types\n\n" + _table(FailureType, FAILURE_TYPE_HELP),
            "## Endpoint faults\n\n"
            "What went wrong with a request to a remote endpoint when it is the endpoint's "
            "doing, not the item's: `llm-batch status` and `llm-batch endpoint show` name "
            "the last one with its message. See "
            "[Remote endpoints](../guides/remote-endpoints.md).\n\n"
            + _table(EndpointFault, ENDPOINT_FAULT_HELP),
        ],
    )


_Member = TypeVar("_Member", bound=enum.StrEnum)


def _table(members: type[_Member], help: Mapping[_Member, Explanation]) -> str:
    missing = [m.value for m in members if m not in help]
    if missing:
        raise ValueError(f"no cause and remedy declared for {', '.join(missing)}")
    return table(
        ["Name", "Cause", "What to do"],
        [(code(m.value), help[m].cause, help[m].remedy) for m in members],
    )
