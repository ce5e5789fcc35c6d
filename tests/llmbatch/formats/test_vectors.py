"""Staged vectors: the ledger's pointer into an object, and reading a shard's back."""

from __future__ import annotations

import array
from datetime import UTC, datetime

from llmbatch import ledger
from llmbatch.contract.states import ItemStatus
from llmbatch.formats.vectors import StagedVectors, floats, read_vectors


def f32(*values: float) -> bytes:
    return array.array("f", values).tobytes()


def row(
    item_id: str, status: ItemStatus, result: dict[str, object] | None
) -> ledger.items.LedgerRow:
    return ledger.items.LedgerRow(
        item_id=item_id,
        ordinal=0,
        status=status,
        attempt=1,
        source=None,
        result=result,
        prompt_tokens=1,
        completion_tokens=0,
        latency_ms=None,
        error_class=None,
        error_message=None,
        finished_at=datetime.now(UTC),
    )


def test_a_staged_pointer_round_trips_through_the_ledgers_json() -> None:
    staged = StagedVectors(vectors="s3://b/o.f32", offset=8, count=2, dimensions=1)
    assert StagedVectors.of(staged.model_dump()) == staged
    assert StagedVectors.of({"text": "a generated answer"}) is None
    assert StagedVectors.of(None) is None
    assert staged.slices(f32(9, 9, 1.5, -2)) == [f32(1.5), f32(-2)]


async def test_each_object_is_read_once_and_only_succeeded_items_get_vectors() -> None:
    objects = {"o1": f32(1, 2, 3, 4), "o2": f32(5, 6)}
    reads: list[str] = []

    async def read(uri: str) -> bytes:
        reads.append(uri)
        return objects[uri]

    def at(uri: str, offset: int, count: int) -> dict[str, object]:
        return StagedVectors(vectors=uri, offset=offset, count=count, dimensions=2).model_dump()

    entries = [
        row("a", ItemStatus.SUCCEEDED, at("o1", 0, 1)),
        row("b", ItemStatus.SUCCEEDED, at("o1", 8, 1)),
        row("c", ItemStatus.SUCCEEDED, at("o2", 0, 1)),
        row("d", ItemStatus.DEAD, None),
    ]
    got = await read_vectors(read, entries)
    assert sorted(reads) == ["o1", "o2"]
    assert {k: [floats(v) for v in vs] for k, vs in got.items()} == {
        "a": [[1.0, 2.0]],
        "b": [[3.0, 4.0]],
        "c": [[5.0, 6.0]],
    }
