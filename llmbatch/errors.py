"""The root of llm-batch's exceptions.

Every llm-batch error descends from :class:`LlmBatchError`, so a caller embedding
llm-batch catches all of them, and nothing else, with one ``except LlmBatchError``.
A class that callers also catch by a built-in (``ValueError``, ``RuntimeError``)
keeps that base beside this one: ``class TemplateError(LlmBatchError, ValueError)``.

This module imports nothing: the contract's errors descend from it, and workflow code
(which the Temporal sandbox re-imports on every run) imports the contract. Every
package of llmbatch may import it (tests/llmbatch/workflows/test_imports.py).
"""


class LlmBatchError(Exception):
    """An error of llm-batch: every exception class llm-batch defines descends from it."""
