"""The reference section's front page: what each generated page holds."""

from __future__ import annotations

from llmbatch.reference.markdown import page

_PAGES = (
    ("cli.md", "CLI", "every `llm-batch` command and option, with its help"),
    ("settings.md", "Settings", "every `LLMBATCH_*` variable, its default and meaning"),
    ("job-spec.md", "Job spec", "the JobSpec a job is started with, field by field"),
    ("errors.md", "Error classes", "why an item dies or a step fails, and what to do"),
    ("metrics.md", "Metrics", "the OpenTelemetry instruments llm-batch reports"),
)


def render() -> str:
    lines = [f"- [{title}]({name}): {what}." for name, title, what in _PAGES]
    return page(
        "Reference",
        "These pages are generated from the code by `llm-batch docs generate`, and a test "
        "fails when they fall behind it, so they describe the version they ship with.",
        ["\n".join(lines)],
    )
