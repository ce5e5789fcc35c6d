"""The item ledger: one row per (job, item), the source of truth for "done".

An item's status moves only along :data:`llmbatch.contract.states.ITEM_TRANSITIONS`
(``pending → running → succeeded | dead``; a terminal status never changes except
through the dead-letter re-drive, :func:`llmbatch.ledger.dead_letters.requeue_dead`).
Writes are batched through ``unnest`` arrays, one statement per batch, and fenced by
lease: a result lands only while the writer's ``lease_owner`` still holds the item, so
an attempt that outlived its heartbeat timeout cannot overwrite a newer one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

import asyncpg

from llmbatch.contract.states import (
    ErrorClass,
    ItemStatus,
    ResultSource,
)
from llmbatch.ledger.db import TERMINAL, THIS_JOB, Database, batch_rows, transaction


@dataclass(slots=True)
class NewItem:
    """An item to register: ``ordinal`` is its position in the input (output order)."""

    item_id: str
    ordinal: int
    prompt_hash: str | None
    source: str


@dataclass(slots=True)
class Answered:
    """Items that registering answered, of one result source (``deduplicated``: the
    job's own lead or cache entry; ``cached``: another job's entry), and their tokens."""

    source: ResultSource
    items: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class Registered:
    """What registering a shard's items found: ids already finished (those answered
    now among them), ids that another shard of the job registered first (a repeated
    item id), and what was answered."""

    done: set[str]
    elsewhere: set[str]
    answered: list[Answered] = field(default_factory=list)


@dataclass(slots=True)
class ItemResult:
    """A successful generation; ``result`` holds text, parsed output, finish reason."""

    item_id: str
    result: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    result_source: ResultSource = ResultSource.GENERATED
    shared_with: str | None = None


@dataclass(slots=True)
class DeadItem:
    """An item that can never succeed, and why."""

    item_id: str
    shard: int
    error_class: ErrorClass
    error_message: str
    source: str | None


@dataclass(slots=True)
class LedgerRow:
    """One item as the ledger has it, for writing output."""

    item_id: str
    ordinal: int
    status: ItemStatus
    attempt: int
    source: str | None
    result: dict[str, Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_ms: float | None
    error_class: ErrorClass | None
    error_message: str | None
    finished_at: datetime | None
    result_source: ResultSource | None = None
    shared_with: str | None = None


@dataclass(frozen=True, slots=True)
class AnswerSql:
    """How registering answers new items as it writes them, in the same statement:
    SQL that whoever answers them owns (:data:`llmbatch.dedup.leads.REGISTER_ANSWERS`:
    the job's leads and the result cache), put into :func:`register_items`'s.

    ``keys`` names per-item text columns added to the batch ``t`` (item_id, ordinal,
    prompt_hash, source, then these); ``answers`` is a query over ``t`` giving each of
    its rows those four columns and ``result``, ``prompt_tokens``,
    ``completion_tokens``, ``result_source`` and ``shared_with`` (all NULL: not
    answered, written pending); ``after`` adds CTEs (each starting with a comma) that
    run with the insert, over ``t`` and ``registered`` (its rows written: item_id,
    status). They name the statement's parameters as ``{job_id}``, ``{shard}``,
    ``{pending}``, ``{succeeded}`` (:class:`_Params`) and ``{this_job}``
    (:data:`~llmbatch.ledger.db.THIS_JOB`), their key columns' arrays as
    ``{<key>}``, and their own parameters, ``params``, by those names."""

    keys: tuple[str, ...]
    params: tuple[str, ...]
    answers: str
    after: str = ""


@dataclass(frozen=True, slots=True)
class Answering:
    """An :class:`AnswerSql` with its values for one registration: ``keys`` holds one
    list per key column, in the order of the items registered, and ``params`` the
    values of its parameters."""

    sql: AnswerSql
    keys: tuple[Sequence[str | None], ...]
    params: tuple[Any, ...]


class _Params(NamedTuple):
    """The register statement's own parameters, in their order ($1, $2, ...)."""

    job_id: str
    shard: int
    item_ids: list[str]
    ordinals: list[int]
    prompt_hashes: list[str | None]
    sources: list[str]
    terminal: list[str]
    pending: str
    succeeded: str


# Not answered: every item written pending.
_UNANSWERED = AnswerSql(
    keys=(),
    params=(),
    answers="""
        SELECT t.item_id, t.ordinal, t.prompt_hash, t.source, NULL::jsonb AS result,
               NULL::integer AS prompt_tokens, NULL::integer AS completion_tokens,
               NULL::text AS result_source, NULL::text AS shared_with
        FROM t""",
)


def _answer(column: str) -> str:
    # An existing row takes the answer only while pending (a stale render attempt
    # never touches what a generate attempt holds or finished).
    return (
        f"{column} = CASE WHEN items.status = {{pending}} AND EXCLUDED.status = {{succeeded}} "
        f"THEN EXCLUDED.{column} ELSE items.{column} END"
    )


# Registering a shard's items, answered as :class:`AnswerSql` has it: as a plain insert
# or one that updates ids already there (/*conflict*/).
_REGISTER = """
    WITH t AS (
        SELECT * FROM unnest({item_ids}::text[], {ordinals}::bigint[],
                             {prompt_hashes}::text[], {sources}::text[]/*key arrays*/)
            AS t(item_id, ordinal, prompt_hash, source/*key columns*/)
    ), answers AS (/*answers*/
    ), registered AS (
        INSERT INTO items (job_id, item_id, shard, ordinal, prompt_hash, source,
                           status, result, prompt_tokens, completion_tokens,
                           latency_ms, result_source, shared_with, finished_at)
        SELECT {job_id}, a.item_id, {shard}, a.ordinal, a.prompt_hash, a.source,
               CASE WHEN a.result_source IS NULL THEN {pending} ELSE {succeeded} END,
               a.result, a.prompt_tokens, a.completion_tokens,
               CASE WHEN a.result_source IS NOT NULL THEN 0.0 END,
               a.result_source, a.shared_with,
               CASE WHEN a.result_source IS NOT NULL THEN now() END
        FROM answers AS a
        /*conflict*/
        RETURNING item_id, status, result_source, prompt_tokens, completion_tokens
    )/*after*/
    -- The ids written and left to run (not those finished: a cached shard's
    -- are all of them), what answered the others, and how many rows were
    -- written: when that is every item, no id needs looking up again (below).
    SELECT 'pending' AS kind, item_id, NULL AS result_source, 0::bigint AS items,
           0::bigint AS prompt_tokens, 0::bigint AS completion_tokens
    FROM registered WHERE status <> ALL({terminal}::text[])
    UNION ALL
    SELECT 'answered', NULL, result_source, count(*),
           coalesce(sum(prompt_tokens), 0)::bigint,
           coalesce(sum(completion_tokens), 0)::bigint
    FROM registered WHERE status = {succeeded} GROUP BY result_source
    UNION ALL
    SELECT 'written', NULL, NULL, count(*), 0, 0 FROM registered
"""

# Rows already there: a retried registration, or ids that another shard holds.
_ON_CONFLICT = f"""
ON CONFLICT (job_id, item_id) DO UPDATE
    SET prompt_hash = EXCLUDED.prompt_hash, updated_at = now(),
        {_answer("status")}, {_answer("result")}, {_answer("prompt_tokens")},
        {_answer("completion_tokens")}, {_answer("latency_ms")},
        {_answer("result_source")}, {_answer("shared_with")},
        {_answer("finished_at")}, {_answer("error_class")},
        {_answer("error_message")}
    WHERE items.shard = EXCLUDED.shard AND items.status <> ALL({{terminal}}::text[])
"""
# A shard's placeholders (rows a failed attempt never read) and their dead letters.
_CLEAR_PLACEHOLDERS = f"""
    WITH gone AS (
        DELETE FROM items WHERE job_id = {THIS_JOB} AND shard = $2 AND placeholder
        RETURNING item_id
    )
    DELETE FROM dead_letters AS d USING gone
    WHERE d.job_id = $1 AND d.item_id = gone.item_id
"""


@functools.cache
def _register_sql(answering: AnswerSql, *, checked: bool) -> str:
    """The register statement answering as ``answering`` has it, checking for ids
    already there when ``checked``; its parameters numbered in the order of
    :class:`_Params`, then ``answering``'s key arrays, then its own."""
    names = [*_Params._fields, *answering.keys, *answering.params]
    numbers = {name: f"${n}" for n, name in enumerate(names, start=1)}
    assert numbers["job_id"] == "$1"  # THIS_JOB names it so
    text = (
        _REGISTER.replace("/*key arrays*/", "".join(f", {{{k}}}::text[]" for k in answering.keys))
        .replace("/*key columns*/", "".join(f", {k}" for k in answering.keys))
        .replace("/*answers*/", answering.answers)
        .replace("/*after*/", answering.after)
        .replace("/*conflict*/", _ON_CONFLICT if checked else "")
    )
    return text.format(this_job=THIS_JOB, **numbers)


async def register_items(
    pool: Database,
    *,
    job_id: str,
    shard: int,
    items: Sequence[NewItem],
    answering: Answering | None = None,
) -> Registered:
    """Insert pending rows for new items; report those already finished and those
    another shard holds (which this shard must not run).

    With ``answering``, an item it answers is written succeeded at once with that
    result (one write instead of pending, claimed, succeeded), as a generate attempt
    would have recorded it, and what its SQL adds runs with the insert (see
    :class:`AnswerSql`). Of an item already registered only a pending one takes the
    answer.

    Placeholders of the shard (rows a failed attempt never read) give way to the
    real items here, and their dead letters go with them.
    """
    if not items:
        return Registered(done=set(), elsewhere=set())
    ids = [i.item_id for i in items]
    sql = _UNANSWERED if answering is None else answering.sql
    args = (
        *_Params(
            job_id=job_id,
            shard=shard,
            item_ids=ids,
            ordinals=[i.ordinal for i in items],
            prompt_hashes=[i.prompt_hash for i in items],
            sources=[i.source for i in items],
            terminal=TERMINAL,
            pending=ItemStatus.PENDING,
            succeeded=ItemStatus.SUCCEEDED,
        ),
        *(() if answering is None else (*answering.keys, *answering.params)),
    )
    async with transaction(pool) as conn:
        await conn.execute(
            _CLEAR_PLACEHOLDERS,
            job_id,
            shard,
        )
        try:
            # A shard's first registration finds none of its ids: a plain insert, a
            # third cheaper for Postgres than one that checks each row for a conflict
            # (a speculative insertion and its confirmation, per row). In a savepoint,
            # so that an id already there undoes it and the checked insert runs instead.
            async with conn.transaction():
                answered = await conn.fetch(_register_sql(sql, checked=False), *args)
        except asyncpg.UniqueViolationError:
            answered = await conn.fetch(_register_sql(sql, checked=True), *args)
        elsewhere: set[str] = set()
        if next(r["items"] for r in answered if r["kind"] == "written") == len(ids):
            done = set(ids).difference(r["item_id"] for r in answered if r["kind"] == "pending")
        else:
            # Some ids were already there and not written: finished before, or another
            # shard's. A separate statement, so it also sees a concurrent shard's insert
            # of the same id, which the insert above waited for and found taken; it
            # finds those finished just now as well.
            rows = await conn.fetch(
                "SELECT item_id, shard <> $3 AS elsewhere FROM items "
                "WHERE job_id = $1 AND item_id = ANY($2::text[]) "
                "AND (shard <> $3 OR status = ANY($4::text[]))",
                job_id,
                ids,
                shard,
                TERMINAL,
            )
            done = {r["item_id"] for r in rows if not r["elsewhere"]}
            elsewhere = {r["item_id"] for r in rows if r["elsewhere"]}
    return Registered(
        done=done,
        elsewhere=elsewhere,
        answered=[
            Answered(
                source=ResultSource(r["result_source"]),
                items=r["items"],
                prompt_tokens=r["prompt_tokens"],
                completion_tokens=r["completion_tokens"],
            )
            for r in answered
            if r["kind"] == "answered"
        ],
    )


# Statements over a batch of a job's items: see THIS_JOB in llmbatch.ledger.db for why
# they compare items with THIS_JOB and the batch's own columns.
_CLAIM = f"""
    UPDATE items SET status = $6, lease_owner = $3, lease_activity = $4,
                     lease_attempt = $5, attempt = attempt + 1,
                     started_at = now(), updated_at = now()
    WHERE job_id = {THIS_JOB} AND item_id = ANY($2::text[]) AND status <> ALL($7::text[])
      AND NOT (status = $6 AND $4::text IS NOT NULL AND lease_activity = $4
               AND lease_attempt > $5)
    RETURNING item_id
"""

_RESULTS = batch_rows(
    "$3::text[], $4::text[], $5::int[], $6::int[], $7::float8[], $10::text[], $11::text[]",
    "item_id, result, prompt_tokens, completion_tokens, latency_ms, result_source, shared_with",
    carried="$2::text AS lease_owner, $9::text AS running",
)
_RECORD = f"""
    UPDATE items AS i
    SET status = $8, result = r.result::jsonb, prompt_tokens = r.prompt_tokens,
        completion_tokens = r.completion_tokens, latency_ms = r.latency_ms,
        result_source = r.result_source, shared_with = r.shared_with,
        error_class = NULL, error_message = NULL, finished_at = now(), updated_at = now()
    FROM {_RESULTS} AS r
    WHERE i.job_id = {THIS_JOB} AND i.item_id = r.item_id
      AND i.lease_owner = r.lease_owner AND i.status = r.running
"""

_DYING = batch_rows(
    "$2::text[], $3::text[], $4::text[], $5::text[]",
    "item_id, error_class, error_message, source",
    carried="$6::text AS lease_owner, $8::text[] AS terminal, $9::text AS running",
)
_DEAD = f"""
    WITH marked AS (
        UPDATE items AS i
        SET status = $7, error_class = d.error_class, error_message = d.error_message,
            source = COALESCE(d.source, i.source), finished_at = now(), updated_at = now()
        FROM {_DYING} AS d
        WHERE i.job_id = {THIS_JOB} AND i.item_id = d.item_id
          AND i.status <> ALL(d.terminal)
          AND (d.lease_owner IS NULL OR (i.lease_owner = d.lease_owner AND i.status = d.running))
        RETURNING i.item_id, i.shard, i.error_class, i.error_message, i.source, i.attempt
    ), listed AS (
        INSERT INTO dead_letters
            (job_id, item_id, shard, error_class, error_message, source, attempts)
        SELECT $1, item_id, shard, error_class, error_message, source, attempt FROM marked
        ON CONFLICT (job_id, item_id) DO UPDATE
            SET error_class = EXCLUDED.error_class, error_message = EXCLUDED.error_message,
                attempts = EXCLUDED.attempts, created_at = now(), redriven_at = NULL
        RETURNING 1
    )
    SELECT count(*) FROM marked
"""


async def claim_items(
    pool: Database,
    *,
    job_id: str,
    item_ids: Sequence[str],
    lease_owner: str,
    activity: str | None = None,
    attempt: int | None = None,
) -> set[str]:
    """Take the unfinished ones of ``item_ids`` for ``lease_owner``; return those taken.

    With ``activity`` and ``attempt`` (the Temporal activity and its attempt number),
    items that a newer attempt of the same activity holds are left alone: a stale
    attempt that starts late must not take them back.
    """
    if not item_ids:
        return set()
    rows = await pool.fetch(
        _CLAIM,
        job_id,
        list(item_ids),
        lease_owner,
        activity,
        attempt,
        ItemStatus.RUNNING,
        TERMINAL,
    )
    return {r["item_id"] for r in rows}


async def record_results(
    pool: Database, *, job_id: str, lease_owner: str, results: Sequence[ItemResult]
) -> int:
    """Mark items succeeded where ``lease_owner`` still holds them; return rows written."""
    if not results:
        return 0
    status = await pool.execute(
        _RECORD,
        job_id,
        lease_owner,
        [r.item_id for r in results],
        _result_texts(results),
        [r.prompt_tokens for r in results],
        [r.completion_tokens for r in results],
        [r.latency_ms for r in results],
        ItemStatus.SUCCEEDED,
        ItemStatus.RUNNING,
        [str(r.result_source) for r in results],
        [r.shared_with for r in results],
    )
    return int(status.rsplit(" ", 1)[1])


def _result_texts(results: Sequence[ItemResult]) -> list[str]:
    """Each result as JSON text; a result shared by many items (a dedup group, a cache
    hit) is one object, encoded once."""
    texts: dict[int, str] = {}
    out = []
    for r in results:
        text = texts.get(id(r.result))
        if text is None:
            text = texts[id(r.result)] = json.dumps(r.result)
        out.append(text)
    return out


async def record_dead(
    pool: Database, *, job_id: str, lease_owner: str | None, items: Sequence[DeadItem]
) -> int:
    """Mark items dead and list them as dead letters; return rows marked.

    With a ``lease_owner`` only items it holds change (like results); without one,
    any unfinished item does (rows that failed before anything claimed them).
    """
    if not items:
        return 0
    count = await pool.fetchval(
        _DEAD,
        job_id,
        [i.item_id for i in items],
        [i.error_class for i in items],
        [i.error_message for i in items],
        [i.source for i in items],
        lease_owner,
        ItemStatus.DEAD,
        TERMINAL,
        ItemStatus.RUNNING,
    )
    return int(count)


async def shard_results(pool: Database, *, job_id: str, shard: int) -> list[LedgerRow]:
    """Every item of a shard, in input order."""
    rows = await pool.fetch(
        """
        SELECT item_id, ordinal, status, attempt, source, result, prompt_tokens,
               completion_tokens, latency_ms, error_class, error_message, finished_at,
               result_source, shared_with
        FROM items WHERE job_id = $1 AND shard = $2 ORDER BY ordinal, item_id
        """,
        job_id,
        shard,
    )
    # By position, in the SELECT's order: the write step reads every item of a shard,
    # and building each row from a dict of its columns cost a few microseconds an item.
    status, error_class, source = _STATUSES, _ERROR_CLASSES, _SOURCES
    return [
        LedgerRow(
            r[0],
            r[1],
            status[r[2]],
            r[3],
            r[4],
            r[5],
            r[6],
            r[7],
            r[8],
            r[9] and error_class[r[9]],
            r[10],
            r[11],
            r[12] and source[r[12]],
            r[13],
        )
        for r in rows
    ]


_STATUSES = {s.value: s for s in ItemStatus}
_ERROR_CLASSES = {c.value: c for c in ErrorClass}
_SOURCES = {s.value: s for s in ResultSource}


async def items_by_id(
    pool: Database, *, job_id: str, item_ids: Sequence[str]
) -> dict[str, LedgerRow]:
    """The ledger rows of ``item_ids`` (those the job has), by item id."""
    rows = await pool.fetch(
        f"""
        SELECT item_id, ordinal, status, attempt, source, result, prompt_tokens,
               completion_tokens, latency_ms, error_class, error_message, finished_at
        FROM items WHERE job_id = {THIS_JOB} AND item_id = ANY($2::text[])
        """,
        job_id,
        list(item_ids),
    )
    return {
        r["item_id"]: LedgerRow(
            **{
                **dict(r),
                "status": ItemStatus(r["status"]),
                "error_class": r["error_class"] and ErrorClass(r["error_class"]),
            }
        )
        for r in rows
    }


async def release_items(
    pool: Database,
    *,
    job_id: str,
    lease_owner: str,
    item_ids: Sequence[str],
    refund: bool = False,
) -> int:
    """Give back the items ``lease_owner`` still holds (status ``pending`` again); return
    how many. Used when an attempt is cancelled, so its unfinished items are not left
    ``running`` with nobody working on them. With ``refund`` (a drained worker gives
    them back) the claim is not counted as an attempt of theirs."""
    if not item_ids:
        return 0
    status = await pool.execute(
        f"""
        UPDATE items SET status = $4, lease_owner = NULL, started_at = NULL,
                         attempt = CASE WHEN $6 THEN greatest(attempt - 1, 0) ELSE attempt END,
                         updated_at = now()
        WHERE job_id = {THIS_JOB} AND item_id = ANY($3::text[]) AND lease_owner = $2
          AND status = $5
        """,
        job_id,
        lease_owner,
        list(item_ids),
        ItemStatus.PENDING,
        ItemStatus.RUNNING,
        refund,
    )
    return int(status.rsplit(" ", 1)[1])
