"""Remote endpoints: OpenAI-compatible servers and APIs that llm-batch calls.

Owns the endpoint registry in Postgres (:mod:`.endpoints`), the rate-limit budget
every worker of an endpoint shares (:mod:`.budget`), the HTTP client and its error
classes (:mod:`.http`), and the remote engine (:mod:`.engine`), the second
implementation of :class:`llmbatch.engine_interface.InferenceEngine` that the
``generate`` activity drives exactly as it drives the in-process vLLM engine.
"""
