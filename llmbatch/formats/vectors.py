"""An embed job's vectors: where the ledger says they are staged, and reading them back.

Vectors never go to the ledger (a million 4,096-dimension vectors are 16 GB). The
generate activity writes each flush's vectors as one object of little-endian float32
bytes under the job's output prefix; an item's ledger result is a :class:`StagedVectors`
naming its slice of such an object. The shard writer and the API's batch files read
them back, an object at a time.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from llmbatch.contract.states import ItemStatus

# An item's vectors, by item id: each one's float32 bytes (little-endian, as staged).
Vectors = dict[str, list[bytes]]


if TYPE_CHECKING:
    from llmbatch.ledger.items import LedgerRow


class StagedVectors(BaseModel):
    """A succeeded embed item's ledger result: ``count`` vectors of ``dimensions``
    float32 each, one after another from byte ``offset`` of object ``vectors``."""

    vectors: str
    offset: int
    count: int
    dimensions: int

    @classmethod
    def of(cls, result: dict[str, Any] | None) -> StagedVectors | None:
        """The staged vectors a ledger result names; None for any other result."""
        if not result or "vectors" not in result:
            return None
        return cls.model_validate(result)

    def slices(self, data: bytes) -> list[bytes]:
        """This item's vectors out of its object's bytes."""
        size = 4 * self.dimensions
        return [
            data[self.offset + i * size : self.offset + (i + 1) * size] for i in range(self.count)
        ]


async def read_vectors(
    read: Callable[[str], Awaitable[bytes]], entries: Iterable[LedgerRow]
) -> Vectors:
    """The vectors of the succeeded items among ``entries``, each object read once
    (a shard's items point to a few objects of up to a flush's worth each)."""
    by_object: dict[str, list[tuple[str, StagedVectors]]] = {}
    for e in entries:
        staged = StagedVectors.of(e.result) if e.status is ItemStatus.SUCCEEDED else None
        if staged is not None:
            by_object.setdefault(staged.vectors, []).append((e.item_id, staged))
    out: Vectors = {}
    for uri, items in by_object.items():
        data = await read(uri)
        for item_id, staged in items:
            out[item_id] = staged.slices(data)
    return out


def floats(vector: bytes) -> list[float]:
    """A staged vector as Python floats."""
    values = array.array("f")
    values.frombytes(vector)
    if sys.byteorder != "little":  # staged little-endian, whatever the machine
        values.byteswap()
    return values.tolist()
