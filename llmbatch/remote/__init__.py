"""Remote endpoints: OpenAI-compatible servers and APIs that llm-batch calls.

Owns the endpoint registry in Postgres (:mod:`.endpoints`), the models routed to
endpoints (:mod:`.routes`, read by the Batch API, submit and schedules), the rate-limit budget
every worker of an endpoint shares (:mod:`.budget`), the HTTP client and its error
classes (:mod:`.http`), and the remote engine (:mod:`.engine`), the second
implementation of :class:`llmbatch.engine.base.BatchEngine` that the
``generate`` activity drives exactly as it drives the in-process vLLM engine;
``pause`` (a job paused by llm-batch, with why), ``usage`` and ``status`` (what
operators see). The remote engine lives here, not in ``llmbatch.engine``, because
it keeps its rate budget and figures in Postgres, which the engine package may not
touch.

May import: ``llmbatch.contract``, ``llmbatch.engine``, ``llmbatch.ledger.db`` (the
pool type and the pool) and ``llmbatch.telemetry``.
"""
