"""A worker's cold start, measured and told: its phases and their seconds, and a
ready file for Kubernetes' readiness probe.

Scaling from zero costs a job one cold start per new pod; the worker prints where
that time goes (Python and vLLM imports, the service checks, the engine load, which
includes weight loading and vLLM's compile or graph capture, the worker start), so
operators can see what a compile cache or a faster load format saves. Once started, a
worker advertises its queue in the ledger (:func:`advertise`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path

import psutil
from temporalio.worker import Worker

from llmbatch.config import Settings
from llmbatch.contract.spec import Task
from llmbatch.ledger.db import Database
from llmbatch.ledger.served_models import CachePolicy, ServedQueue, advertised


class ColdStart:
    """Phases since the process started (its creation time, so imports count)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = psutil.Process().create_time()
        self._last = self._started
        self.phases: list[tuple[str, float]] = []

    def phase(self, label: str) -> None:
        """Close the phase that ends now, named ``label``."""
        now = time.time()
        self.phases.append((label, now - self._last))
        self._last = now

    @property
    def total_s(self) -> float:
        return self._last - self._started

    def report(self) -> str:
        parts = ", ".join(f"{label} {seconds:.1f} s" for label, seconds in self.phases)
        return f"{self._name} cold start: {parts}; polling {self.total_s:.1f} s after launch"


def mark_ready(path: Path | None) -> None:
    """Write the ready file (the engine is loaded and the worker polls)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{time.time():.0f}\n")


def clear_ready(path: Path | None) -> None:
    """Remove the ready file (the worker drains or stops)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# The collector's thresholds in a running worker (CPython's are 700, 10, 10). A worker
# makes objects by the shard: a shard's rows, ledger rows and output lines, tens of
# thousands that live until its step ends. At 700 a young collection ran every few
# rows and walked every one of them still alive, and they reached the oldest
# generation in a few shards, whose full collections walked them again: an eighth of
# the CPU worker's time on the cached path (measured with gc.callbacks, 0.9 s of about
# 7.5 s over 8 cached jobs of 10,000 rows). 50,000 lets most of them die before a
# collection looks at them; full collections still come (every 10 of the middle ones),
# so a cycle holding a shard's rows is freed within a few shards.
GC_THRESHOLDS = (50_000, 20, 10)


def tune_garbage_collector() -> None:
    """Set the collector for a worker that has started: every object alive now
    (imported modules, the engine, the Temporal SDK) is moved out of its sight, as
    they live as long as the process and each full collection walked all of them
    again (about 0.1 s each over ~120,000 startup objects, inside the per-item loops);
    and later objects are collected at :data:`GC_THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def advertise(
    pool: Database,
    worker: Worker,
    *,
    model: str,
    task: Task,
    weights: str | None,
    settings: Settings,
) -> contextlib.AbstractAsyncContextManager[None]:
    """Record ``worker``'s queue, model and cache use in the ledger while it runs, so
    `GET /v1/models` and `llm-batch queues` can name the model behind a hashed queue,
    and the prepare step answers from the result cache as this worker would."""
    return advertised(
        pool,
        ServedQueue(
            task_queue=worker.task_queue,
            model=model,
            task=task,
            identity=worker.client.identity,
            policy=CachePolicy(
                weights=weights,
                cache=settings.cache,
                shared=settings.cache_shared_across_tenants,
            ),
        ),
    )
