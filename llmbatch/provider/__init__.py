"""Provider batches: a job's shards handed to an endpoint's OpenAI Files + Batches API.

This package owns what an endpoint declares about its Batch API (prices, limits; in
Postgres beside the endpoint), the HTTP client for the provider's files and batches,
the request lines sent and the answer lines read back, and the ``provider_batches``
table that records every batch llm-batch creates before it waits for it. The
activities are :mod:`llmbatch.activities.provider_batch`, the waiting is
:mod:`llmbatch.workflows.provider_batch`'s. Only OpenAI's shape is built; another provider's
(Anthropic's Message Batches) would be another :class:`~llmbatch.provider.client.BatchClient`.

It imports the contract, the ledger's database, the endpoint registry and HTTP helpers
of :mod:`llmbatch.remote`, the engine's request and result types, and the OpenAI
batch format's codes.
"""
