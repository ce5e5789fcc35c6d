"""The metrics reference: the instruments declared in :mod:`llmbatch.telemetry`."""

from __future__ import annotations

from llmbatch.reference.markdown import code, page, table
from llmbatch.telemetry import INSTRUMENTS


def render() -> str:
    rows = [
        (
            code(i.name),
            i.kind,
            code(i.unit),
            ", ".join(code(a) for a in i.attributes),
            i.description,
        )
        for i in INSTRUMENTS
    ]
    return page(
        "Metrics",
        "The OpenTelemetry instruments every llm-batch process reports once an exporter is "
        "configured (see [Traces and metrics](../operations/metrics.md)). Attributes hold a "
        "job id, a model and a few fixed values, never an item id or row data.",
        [table(["Name", "Kind", "Unit", "Attributes", "Description"], rows)],
    )
