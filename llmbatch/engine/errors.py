"""Errors of starting an engine, apart so that options, cpu and base share them
without importing one another."""


class EngineArgumentError(ValueError):
    """An engine argument vLLM does not declare, or a value it refuses; one line."""
