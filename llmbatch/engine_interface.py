"""What the ``generate`` activity needs of an engine: one interface, two engines.

:class:`llmbatch.engine.Engine` runs vLLM in the worker's own process;
:class:`llmbatch.remote.engine.RemoteEngine` calls an OpenAI-compatible endpoint.
The activity loop (claims fenced by lease, heartbeats and resume, pause, dedup
leads, the result cache, dead letters, usage) is written once against this.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the request and result types live beside the vLLM engine
    from llmbatch.engine import (
        EmbeddingRequest,
        EmbeddingResult,
        EngineUsage,
        GenerationRequest,
        GenerationResult,
    )


class EndpointRefusedError(RuntimeError):
    """The engine cannot serve any request of the job as configured: the endpoint
    refused its API key (401/403), or does not serve the model. Not an item's fault
    and not transient: the job is paused (its items stay pending) until fixed.
    ``str()`` is one line for the user, without the key."""


class InferenceEngine(Protocol):
    """An engine the ``generate`` activity drives."""

    @property
    def model(self) -> str:
        """The model it serves, as jobs name it."""
        ...

    # What identifies the weights answering, for the result cache (None: no cache).
    weights: str | None
    # GPUs one engine occupies (what a GPU-hour price multiplies); 0 for a remote one.
    gpus: int

    @property
    def default_max_in_flight(self) -> int:
        """Requests one activity keeps in flight when the worker does not say."""
        ...

    def generate_many(
        self,
        requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[GenerationResult, None]:
        """Results in completion order; per-item failures come back as results with
        ``error_class`` set; :class:`EndpointRefusedError` and engine deaths raise.
        Closing the iterator aborts what is in flight."""
        ...

    def embed_many(
        self,
        requests: AsyncIterable[EmbeddingRequest] | Iterable[EmbeddingRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[EmbeddingResult, None]:
        """:meth:`generate_many` for embedding requests."""
        ...
