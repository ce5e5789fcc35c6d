"""The ledger: everything llm-batch keeps in Postgres about jobs and their items.

Owns the SQL of the tables of ``migrations/`` but dedup leads
(``llmbatch.dedup.leads``), the result cache (``llmbatch.dedup.result_cache``) and
remote endpoints' registry, budgets and figures (``llmbatch.remote``); registering
items takes the SQL that answers them as they are written from whoever answers them
(``items.AnswerSql``: the job's leads and the cache, ``llmbatch.dedup.leads``), so that
it stays one statement. ``db`` (pool,
transaction), ``items`` (register, claim, record, release: the item state machine of
:data:`llmbatch.contract.states.ITEM_TRANSITIONS`), ``jobs`` (a job's row, plan and
counts), ``dead_letters`` (dead items and the re-drive), ``usage`` (engine time and
cost), ``retention`` (purging finished jobs' rows), ``api_records`` (the OpenAI Batch
API's keys, files and batches) with ``api_layout`` (their ids and object keys),
``served_models`` (which models GPU workers serve, with their weights and cache
settings), ``backlog`` (unfinished items by
model and task, for autoscaling) and ``migrate`` (applying ``migrations/``).

Plain async functions with set-based SQL, bound parameters, and fencing in the WHERE
clause. May import: ``llmbatch.contract`` and asyncpg, nothing else of llmbatch
(no engine, storage, formats, dedup, api or activities).

Callers write ``from llmbatch import ledger`` and ``ledger.items.claim_items(...)``:
the submodules are imported here so each call names the part of the ledger it uses.
"""

from llmbatch.ledger import api_records, db, dead_letters, items, jobs, retention, usage

__all__ = ["api_records", "db", "dead_letters", "items", "jobs", "retention", "usage"]
