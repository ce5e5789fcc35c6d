"""What one row's render may take, apart from the Jinja machinery that enforces it:
the settings and the table jobs name these limits without importing Jinja."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RenderLimits:
    """What one row's render may take: its wall-clock time (enforced by
    :mod:`llmbatch.rendering.pool`), the bytes of all its messages, and the memory of
    the process rendering it."""

    timeout_s: float = 5.0
    max_bytes: int = 4 << 20
    max_memory_bytes: int = 1 << 30
