"""The interface the generate activity uses of an engine, and its usage counter.

No vLLM here: :class:`BatchEngine` is what an engine must offer the activity (the
in-process vLLM engine of :mod:`llmbatch.engine.vllm_engine` today; a remote
endpoint's engine beside it later), so the activity depends on this, not on vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmbatch.engine.requests import (
        EmbeddingRequest,
        EmbeddingResult,
        GenerationRequest,
        GenerationResult,
    )


class EngineUsage:
    """What one caller's requests took of the engine: requests submitted to vLLM (not
    those refused before it) and the time at least one of them was in the engine.

    Counted here, at the adapter, so the figure is the engine's work and nothing else.
    """

    def __init__(self) -> None:
        self.requests = 0
        self._in_engine = 0
        self._busy_since = 0.0
        self._busy_s = 0.0

    @property
    def busy_s(self) -> float:
        """Seconds with at least one request of this caller in the engine, until now."""
        running = time.perf_counter() - self._busy_since if self._in_engine else 0.0
        return self._busy_s + running

    def _entered(self) -> None:
        self.requests += 1
        if self._in_engine == 0:
            self._busy_since = time.perf_counter()
        self._in_engine += 1

    def _left(self) -> None:
        self._in_engine -= 1
        if self._in_engine == 0:
            self._busy_s += time.perf_counter() - self._busy_since


class BatchEngine(Protocol):
    """What the generate activity uses of an engine: the model it serves,
    the fingerprint of its weights (``None``: results are not cached), how many GPUs
    its time counts, and the two bounded, lazy request loops.

    Both loops yield results in completion order with at most ``max_in_flight``
    requests in the engine, carry per-item failures in the result (``error_class``),
    raise when the engine itself is gone, and abort what is in flight when closed.
    """

    weights: str | None
    gpus: int

    def generate_many(
        self,
        requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[GenerationResult, None]: ...

    @property
    def model(self) -> str: ...

    def embed_many(
        self,
        requests: AsyncIterable[EmbeddingRequest] | Iterable[EmbeddingRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[EmbeddingResult, None]: ...
