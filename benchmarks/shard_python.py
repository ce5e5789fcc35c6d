"""The CPU worker's own Python per item of a cached shard, without any server: what
is left when Postgres, the object store and Temporal are taken away.

One shard of ``--requests`` OpenAI batch lines (each distinct request ``--repeat``
times, as ``dedup_cache.py`` writes them) from a local file, through llm-batch's own
functions, phase by phase: reading and parsing the rows (``read``), rendering them
into requests (``render``), their request keys and ledger rows (``keys``), and the
output lines from ledger rows of cached results (``lines``). Beside it, a plain loop
over the same lines does the least such a service can: parse a line, hash its body,
write an output line for it. Prints CPU µs per item of each phase, the best and the
median of ``--rounds`` (process time, so another process's load moves it less), and
their sum against the plain loop's.

It has none of the per-shard costs (Temporal, the ledger's round trips, uploads) and
measures one process alone: use it to compare two versions of the per-item code in
turn, and ``dedup_cache.py`` for what a whole job costs.

    .venv/bin/python benchmarks/shard_python.py --requests 10000 --rounds 15
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from peer import chat_lines

from llmbatch.config import Settings
from llmbatch.contract.spec import InputFormat, JobSpec
from llmbatch.contract.states import ItemStatus, ResultSource
from llmbatch.formats.shards import ShardPlan
from llmbatch.ledger.items import LedgerRow
from llmbatch.stages.encode import OpenAIWriter
from llmbatch.stages.read import _read_rows
from llmbatch.stages.register import _new_items
from llmbatch.stages.render import _key_requests, _render
from llmbatch.storage.stores import open_store
from llmbatch.workers.startup import GC_THRESHOLDS

# A model given as a path, as the benchmarks' tiny model is (its name is then hashed).
MODEL = "/models/tiny-llama"
RESULT = {"text": "A short answer of a few words.", "finish_reason": "length"}


def plain_loop(data: bytes) -> Callable[[], object]:
    """Parse each line, hash its body, write an output line: the least per item."""
    decode, encode = msgspec.json.Decoder().decode, msgspec.json.Encoder().encode

    def run() -> object:
        out = bytearray()
        for line in data.splitlines():
            row = decode(line)
            key = hashlib.sha256(encode(row["body"])).hexdigest()
            out += encode({"id": key, "custom_id": row["custom_id"], "response": RESULT})
            out += b"\n"
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=24, help="times each request appears")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    n = args.requests
    with tempfile.TemporaryDirectory(prefix="llmbatch-shard-python-") as folder:
        path = Path(folder) / "batch.jsonl"
        data = chat_lines(n, model=MODEL, max_tokens=16, repeat=args.repeat)
        path.write_bytes(data)
        os.environ["LLMBATCH_LOCAL_ROOTS"] = folder
        uri = path.as_uri()
        spec = JobSpec(job_id="shard-python", inputs=[uri], model=MODEL, output_uri=uri + ".out")
        size = len(data)
        plan = ShardPlan(index=0, uri=uri, first_row=0, row_count=n, end=size, object_size=size)
        store = open_store(uri, Settings())
        gc.set_threshold(*GC_THRESHOLDS)  # as the workers have it
        now = datetime.now(UTC)
        phases: dict[str, list[float]] = {p: [] for p in ("read", "render", "keys", "lines")}
        plain: list[float] = []
        loop = plain_loop(data)
        for _ in range(args.rounds):
            t0 = time.process_time()
            rows = _read_rows(
                store, plan, InputFormat.OPENAI, id_field=None, max_row_bytes=spec.max_row_bytes
            )
            t1 = time.process_time()
            requests, _ = _render(
                spec, InputFormat.OPENAI, rows, shard=0, overrides={}, rendered={}
            )
            t2 = time.process_time()
            _key_requests(spec, requests)
            items = _new_items(rows, requests)
            t3 = time.process_time()
            entries = [
                LedgerRow(i.item_id, i.ordinal, ItemStatus.SUCCEEDED, 1, i.source, RESULT,
                          20, 16, 0.0, None, None, now, ResultSource.CACHED, None)
                for i in items
            ]  # fmt: skip
            t4 = time.process_time()
            OpenAIWriter(spec).encode(entries, rows={}, vectors={})
            t5 = time.process_time()
            loop()
            t6 = time.process_time()
            for phase, took in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
                phases[phase].append(took / n * 1e6)
            plain.append((t6 - t5) / n * 1e6)
    load = os.getloadavg()[0]
    print(f"{n} requests, {args.rounds} rounds, load {load:.1f}: CPU µs per item, best (median)")
    for phase, times in phases.items():
        print(f"  {phase:8} {min(times):6.2f} ({statistics.median(times):.2f})")
    ours = sum(min(t) for t in phases.values())
    print(f"  {'all':8} {ours:6.2f}")
    print(
        f"  plain loop {min(plain):.2f} ({statistics.median(plain):.2f}): {ours / min(plain):.1f}x"
    )


if __name__ == "__main__":
    main()
