"""What every activity needs at hand: settings, the ledger pool, object storage
(a :class:`~llmbatch.stages.context.PrepareContext`, all the stages need).

Workers build one ActivityContext at start and share it between activities, so
connections are opened once per process, not once per call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import asyncpg

from llmbatch import storage, telemetry
from llmbatch.config import Settings
from llmbatch.contract import uris
from llmbatch.dedup.waits import PREPARE_WAITS_PER_WORKER, WaitSlots
from llmbatch.rendering.pool import RenderPool


@dataclass
class ActivityContext:
    settings: Settings
    pool: asyncpg.Pool
    store: storage.stores.Stores = field(init=False)
    renders: RenderPool = field(init=False)
    lead_waits: WaitSlots = field(init=False)

    def __post_init__(self) -> None:
        # The store for a URI's scheme, created once per worker process.
        self.store = storage.stores.Stores(self.settings)
        # Render processes start on first use; whoever builds the context closes it.
        self.renders = RenderPool(self.settings.render_limits)
        # Prepare steps waiting for other shards' leads, at most so many at once.
        self.lead_waits = WaitSlots(PREPARE_WAITS_PER_WORKER)

    def close(self) -> None:
        """Kill the render processes (a runaway render included)."""
        self.renders.close()

    # boto3 and file I/O block: run them off the event loop that also drives the
    # Temporal worker and, on GPU workers, the engine.

    async def read(self, uri: str) -> bytes:
        store = self.store(uri)
        with telemetry.span("storage.read", **_object_attrs(uri)) as span:
            data = await asyncio.to_thread(store.read_bytes, uri)
            span.set_attributes(telemetry.attrs(bytes=len(data)))
        return data

    async def write(self, uri: str, data: bytes) -> None:
        store = self.store(uri)
        with telemetry.span("storage.write", bytes=len(data), **_object_attrs(uri)):
            await asyncio.to_thread(store.put_bytes, uri, data)


def _object_attrs(uri: str) -> dict[str, str]:
    # The scheme and the object's own name (rows.jsonl, part-00003.parquet): enough to
    # tell the reads and writes of a shard apart, without the bucket or the path.
    scheme = uris.scheme_of(uri)
    return {"scheme": scheme, "object": uri.rstrip("/").rsplit("/", 1)[-1]}
