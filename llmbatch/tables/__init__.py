"""Postgres tables in and out of a job.

- :mod:`~llmbatch.tables.connect`: connecting to a table URI's database (password from
  the worker's environment), the allowed-tables check, and which database errors are
  transient (Temporal retries the step) and which permanent (:class:`TableError`).
- :mod:`~llmbatch.tables.source`: a table or read-only query as input: its fields, a
  sample row, shards cut by key ranges (keyset pagination) and each shard streamed.
- :mod:`~llmbatch.tables.sink`: a table as output: its columns, the check of an
  existing table at submit, and the idempotent bulk upsert of a shard's results.
- :mod:`~llmbatch.tables.jobs`: what planning, fetch and write call.

The URI syntax is :mod:`llmbatch.contract.tables` (no I/O, used in workflows).

May import: ``llmbatch.config``, ``llmbatch.contract``, ``llmbatch.formats`` (rows,
shard plans, the prompt check) and ``llmbatch.rendering.limits`` (render limits);
asyncpg for the databases. The output rows come made (:mod:`llmbatch.stages.encode`).
"""
