"""Errors of starting an engine, apart so that options, cpu and base share them
without importing one another."""

import sys

from llmbatch.errors import LlmBatchError


class EngineArgumentError(LlmBatchError, ValueError):
    """An engine argument vLLM does not declare, or a value it refuses; one line."""


class EndpointRefusedError(LlmBatchError, RuntimeError):
    """A remote endpoint cannot serve any request of the job as configured: it refused
    the API key (401/403), or does not serve the model. Not an item's fault and not
    transient: the generate activity pauses the job (its items stay pending) until it
    is fixed. ``str()`` is one line for the user, without the key."""


def engine_dead(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM's ``EngineDeadError``, told without importing vLLM: a
    process that has not imported it (a remote worker) has no vLLM engine to lose."""
    module = sys.modules.get("vllm.v1.engine.exceptions")
    return module is not None and isinstance(exc, module.EngineDeadError)
