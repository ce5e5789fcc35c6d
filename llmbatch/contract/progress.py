"""How a job's progress reads as text: the Web UI's details line and the CLI's line
share these, so both say the same thing the same way."""

from __future__ import annotations


def format_duration(seconds: float | None) -> str:
    """A short duration: 45s, 3m10s, 2h05m; '-' when unknown."""
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
