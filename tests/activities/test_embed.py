"""Embed jobs end to end: a real embedding worker process (vLLM's pooling runner on the
tiny model), the session's stack and CPU worker, vectors checked against vLLM's own
``LLM.embed`` run in a subprocess of its own (two engines in one process fight).

One embedding worker serves the whole module (tests/fixtures/embed_worker.py); the
SIGKILL test, last, kills it and starts its successor.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from temporalio.client import Client

from llmbatch import ledger, storage
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.dead_letters import DeadLetterView
from llmbatch.contract.spec import EmbedSpec, JobSpec, OutputFormat, Task
from llmbatch.engine.cpu import cpu_engine_env
from tests.fixtures.embed_worker import DIM, HF_OVERRIDES, EmbedWorker
from tests.fixtures.worker_processes import (
    job_result,
    kill_holding_items,
    maps_tcmalloc,
    stop_worker,
)
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow

TEXT = "{{ title }}: {{ body }}"


def rows(n: int) -> list[dict[str, Any]]:
    return [
        {"id": f"r{i:05d}", "title": f"Title {i}", "body": f"body text number {i}"}
        for i in range(n)
    ]


def rendered(row: dict[str, Any]) -> str:
    return f"{row['title']}: {row['body']}"


# vLLM's own embeddings for the same texts, in a process of its own.
REFERENCE = """
import json, sys
from vllm import LLM
from vllm.pooling_params import PoolingParams
model, texts_path, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
texts = json.load(open(texts_path))
llm = LLM(model=model, runner="pooling", convert="embed", max_model_len=max_len,
          dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
          hf_overrides=json.loads(sys.argv[4]))
out = {}
for name, params in {"default": PoolingParams(),
                     "d32_raw": PoolingParams(dimensions=32, use_activation=False)}.items():
    outputs = llm.embed(texts, pooling_params=params, use_tqdm=False)
    out[name] = [o.outputs.embedding for o in outputs]
print("REFERENCE " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(model_name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Starts vLLM's ``LLM.embed`` on the first texts at once; ``reference()`` waits."""
    folder = tmp_path_factory.mktemp("embed-reference")
    texts = folder / "texts.json"
    texts.write_text(json.dumps([rendered(r) for r in rows(40)]))
    proc = subprocess.Popen(
        [sys.executable, "-c", REFERENCE, model_name, str(texts), "512", HF_OVERRIDES],
        stdout=subprocess.PIPE,
        stderr=(folder / "reference.log").open("wb"),
    )
    cache: dict[str, Any] = {}

    def result() -> dict[str, list[list[float]]]:
        if not cache:
            out, _ = proc.communicate(timeout=600)
            line = next(x for x in out.decode().splitlines() if x.startswith("REFERENCE "))
            cache.update(json.loads(line.removeprefix("REFERENCE ")))
        return cache

    try:
        yield result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def norm(a: list[float]) -> float:
    return math.sqrt(sum(x * x for x in a))


def write_rows(path: Path, data: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def embed_spec(path: Path, out: Path, **values: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "job_id": f"embed-{uuid.uuid4().hex[:8]}",
            "task": Task.EMBED,
            "inputs": [str(path)],
            "text": TEXT,
            "id_field": "id",
            "output_uri": f"file://{out}",
            **values,
        }
    )


def jsonl(uri: str) -> list[dict[str, Any]]:
    """The objects of a JSONL output file the job wrote to a local folder."""
    return [json.loads(line) for line in Path(uri.removeprefix("file://")).read_text().splitlines()]


def manifest(summary_manifest: str, settings: Settings) -> dict[str, Any]:
    store = storage.stores.open_store(summary_manifest, settings)
    return dict(json.loads(store.read_bytes(summary_manifest)))


async def test_every_row_once_as_a_fixed_size_vector_equal_to_vllms_own(
    embed_worker: EmbedWorker,
    temporal_client: Client,
    reference: Any,
    tmp_path: Path,
) -> None:
    data = rows(200)
    spec = embed_spec(
        write_rows(tmp_path / "rows.jsonl", data),
        tmp_path / "out",
        model=embed_worker.model,
        output_format=OutputFormat.PARQUET,
        output_fields=["title"],
        shard_size=100,
    )
    handle, _ = await start_job(temporal_client, spec, settings=embed_worker.settings)
    summary = await asyncio.wait_for(job_result(handle), 600)
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (200, 200, 0)

    found = manifest(summary.manifest, embed_worker.settings)
    assert found["embeddings"] == {"count": 200, "dimensions": DIM}
    table = pa.concat_tables(
        [pq.read_table(p.removeprefix("file://")) for p in found["output_parts"]]
    )
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    assert table.column_names[:2] == ["item_id", "title"]
    ids = table.column("item_id").to_pylist()
    assert sorted(ids) == [r["id"] for r in data]
    vectors = dict(zip(ids, table.column("embedding").to_pylist(), strict=True))
    expected = reference()["default"]
    for row, ref in zip(data[:40], expected, strict=True):
        assert cosine(vectors[row["id"]], ref) >= 0.9999
        assert abs(norm(vectors[row["id"]]) - 1.0) < 1e-4  # normalize is the default


async def test_dimensions_and_normalize_are_honoured_and_a_size_the_model_lacks_refused(
    embed_worker: EmbedWorker, temporal_client: Client, reference: Any, tmp_path: Path
) -> None:
    data = rows(40)
    source = write_rows(tmp_path / "rows.jsonl", data)
    spec = embed_spec(
        source,
        tmp_path / "out",
        model=embed_worker.model,
        embedding=EmbedSpec(dimensions=32, normalize=False),
    )
    refused = embed_spec(
        source, tmp_path / "out", model=embed_worker.model, embedding=EmbedSpec(dimensions=48)
    )
    settings = embed_worker.settings
    handles = [(await start_job(temporal_client, s, settings=settings))[0] for s in (spec, refused)]
    summary, refused_summary = [await asyncio.wait_for(job_result(h), 600) for h in handles]

    assert summary.items_succeeded == 40
    out = [r for part in manifest(summary.manifest, settings)["output_parts"] for r in jsonl(part)]
    vectors = {r["item_id"]: r["embedding"] for r in out}
    for row, ref in zip(data, reference()["d32_raw"], strict=True):
        got = vectors[row["id"]]
        assert len(got) == 32
        assert cosine(got, ref) >= 0.9999
        assert abs(norm(got) - norm(ref)) <= 1e-3 * norm(ref)
        assert abs(norm(got) - 1.0) > 1e-2  # not normalized

    # 48 is not one of the model's Matryoshka sizes: vLLM refuses it, every item dies.
    assert (refused_summary.items_succeeded, refused_summary.items_dead) == (0, 40)
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        dead = await ledger.dead_letters.dead_items(pool, job_id=refused.job_id)
    finally:
        await pool.close()
    assert {d.error_class for d in dead} == {"InvalidRequest"}
    assert "48" in dead[0].message


async def test_an_over_long_text_is_dead_lettered_then_redriven_with_truncation(
    embed_worker: EmbedWorker, temporal_client: Client, tmp_path: Path
) -> None:
    data = rows(20)
    data[7]["body"] = "alpha beta gamma delta " * 200  # ~800 tokens against 512
    spec = embed_spec(
        write_rows(tmp_path / "rows.jsonl", data), tmp_path / "out", model=embed_worker.model
    )
    settings = embed_worker.settings
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    summary = await asyncio.wait_for(job_result(handle), 600)
    assert (summary.items_succeeded, summary.items_dead) == (19, 1)

    code, out, err = await cli(settings, "dlq", "list", spec.job_id, "--json")
    assert code == 0, err
    view = DeadLetterView.model_validate_json(out)
    (entry,) = view.entries
    assert (entry.item_id, entry.error_class) == (data[7]["id"], "PromptTooLong")
    assert entry.source is not None and entry.source.endswith(":line 8")  # its line

    # What a crashed attempt leaves: an object written, never recorded. Writing the
    # shard again (the re-drive does) deletes it, and only it.
    folder = Path(summary.manifest.removeprefix("file://")).parent / "_vectors"
    (shard_folder,) = folder.iterdir()
    recorded = sorted(p.name for p in shard_folder.iterdir())
    (shard_folder / "crashed-attempt-00000.f32").write_bytes(b"\0" * 4 * DIM)

    # A sampling option means nothing to an embed job: refused, naming it.
    code, out, err = await cli(settings, "dlq", "redrive", spec.job_id, "--set", "temperature=1")
    assert code != 0 and "temperature" in err, (out, err)

    # Every embed option can be set for the re-drive, not only the truncation.
    sets = ["truncate_prompt_tokens=100", "normalize=false", "dimensions=32"]
    code, out, err = await cli(
        settings, "dlq", "redrive", spec.job_id, *[a for s in sets for a in ("--set", s)], "--json"
    )
    assert code == 0, err
    assert (json.loads(out)["succeeded"], json.loads(out)["dead"]) == (1, 0)
    found = manifest(summary.manifest, settings)
    assert found["embeddings"]["count"] == 20
    lines = [r for part in found["output_parts"] for r in jsonl(part)]
    assert sorted(r["item_id"] for r in lines) == sorted(r["id"] for r in data)
    (long_row,) = [r for r in lines if r["item_id"] == data[7]["id"]]
    assert long_row["error"] is None and long_row["prompt_tokens"] == 100
    assert len(long_row["embedding"]) == 32
    assert abs(norm(long_row["embedding"]) - 1.0) > 1e-2  # not normalized
    # The rest kept the job's own options.
    assert all(len(r["embedding"]) == DIM for r in lines if r is not long_row)
    # The stray went; what the items point to (the re-drive's object too) stayed.
    after = sorted(p.name for p in shard_folder.iterdir())
    assert "crashed-attempt-00000.f32" not in after
    assert set(recorded) < set(after) and len(after) == len(recorded) + 1


async def test_openai_embeddings_lines_run_through_submit(
    embed_worker: EmbedWorker, reference: Any, tmp_path: Path
) -> None:
    texts = [rendered(r) for r in rows(3)]
    lines = [
        {"custom_id": "one", "body": {"input": texts[0]}},
        {"custom_id": "many", "body": {"input": texts[:3], "encoding_format": "base64"}},
        {"custom_id": "short", "body": {"input": texts[0], "dimensions": 32}},
        # Token ids, as OpenAI and vLLM take them (the tiny model's own ids).
        {"custom_id": "tokens", "body": {"input": [1, 2, 3]}},
        {"custom_id": "empty", "body": {"input": ""}},  # that line's 400, never the job's
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text(
        "".join(
            json.dumps({"method": "POST", "url": "/v1/embeddings", **line}) + "\n" for line in lines
        )
    )
    settings = embed_worker.settings
    code, out, err = await cli(
        settings,
        "submit",
        "--input",
        str(source),
        "--model",
        embed_worker.model,
        "--task",
        "embed",
        "--output",
        f"file://{tmp_path / 'out'}",
        "--wait",
        "--json",
    )
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["items_succeeded"], summary["items_dead"]) == (4, 1)
    found = manifest(summary["manifest"], settings)
    assert found["embeddings"]["count"] == 6 and found["embeddings"]["dimensions"] is None
    results = {r["custom_id"]: r for part in found["output_parts"] for r in jsonl(part)}
    body = results["one"]["response"]["body"]
    assert body["object"] == "list" and body["model"] == embed_worker.model
    assert body["usage"]["prompt_tokens"] > 0
    assert body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    expected = reference()["default"]
    assert cosine(body["data"][0]["embedding"], expected[0]) >= 0.9999
    many = results["many"]["response"]["body"]["data"]
    assert [d["index"] for d in many] == [0, 1, 2]
    for item, ref in zip(many, expected[:3], strict=True):
        raw = base64.b64decode(item["embedding"])
        floats = list(memoryview(raw).cast("f"))
        assert len(floats) == DIM and cosine(floats, ref) >= 0.9999
    assert len(results["short"]["response"]["body"]["data"][0]["embedding"]) == 32
    assert len(results["tokens"]["response"]["body"]["data"][0]["embedding"]) == DIM
    errors = [r for part in found["error_parts"] for r in jsonl(part)]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("empty", "InvalidRequest")]


def test_the_embedding_engines_processes_run_with_the_cpu_environment(
    embed_worker: EmbedWorker,
) -> None:
    """The embed worker's engine processes were started with ``cpu_engine_env()``:
    vLLM spawns them, so they are new programs, and tcmalloc, preloaded, is mapped in
    each. (Their environment itself cannot be read back: vLLM's process titles
    overwrite it.)"""
    if "LD_PRELOAD" not in cpu_engine_env(os.environ):
        pytest.skip("tcmalloc is not installed here (scripts/setup.sh installs it as root)")
    processes = [
        p
        for p in psutil.Process(embed_worker.proc.pid).children(recursive=True)
        if p.name().startswith("VLLM::")
    ]
    assert {p.name() for p in processes} >= {"VLLM::EngineCore", "VLLM::Worker"}
    for process in processes:
        assert maps_tcmalloc(process), process.name()


async def test_a_killed_embed_worker_re_embeds_only_what_was_in_flight(
    embed_worker: EmbedWorker, temporal_client: Client, tmp_path: Path
) -> None:
    total, shard = 2000, 250
    spec = embed_spec(
        write_rows(tmp_path / "rows.jsonl", rows(total)),
        tmp_path / "out",
        model=embed_worker.model,
        shard_size=shard,
        max_concurrent_shards=2,
    )
    settings = embed_worker.settings
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        handle, _ = await start_job(temporal_client, spec, settings=settings)
        # Killed while items are claimed and unfinished, not on a shard boundary.
        at_kill = await kill_holding_items(pool, spec.job_id, embed_worker.proc, after=total // 4)
        stop_worker(embed_worker.proc)
        embed_worker.restart()
        summary = await asyncio.wait_for(job_result(handle), 900)
        items = await pool.fetch(
            "SELECT item_id, status, attempt, result FROM items WHERE job_id = $1", spec.job_id
        )
    finally:
        await pool.close()
    assert (summary.items_succeeded, summary.items_dead) == (total, 0)
    assert len(items) == total and {r["status"] for r in items} == {"succeeded"}
    reclaimed = sum(1 for r in items if r["attempt"] > 1)
    assert reclaimed == at_kill.running and 0 < reclaimed <= 2 * shard
    lines = [
        json.loads(line)["item_id"]
        for part in sorted((tmp_path / "out" / spec.job_id).glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]
    assert len(lines) == total and len(set(lines)) == total


async def test_repeated_texts_are_embedded_once_and_every_row_gets_the_vector(
    embed_worker: EmbedWorker, temporal_client: Client, tmp_path: Path
) -> None:
    # 120 rows over 8 distinct texts, in two shards: each text is embedded once in the
    # job (one shard leads it, the other shares), and every row still gets its vector.
    data = [
        {"id": f"d{i:03d}", "title": f"Title {i % 8}", "body": f"body {i % 8}"} for i in range(120)
    ]
    spec = embed_spec(
        write_rows(tmp_path / "rows.jsonl", data),
        tmp_path / "out",
        model=embed_worker.model,
        shard_size=60,
    )
    handle, _ = await start_job(temporal_client, spec, settings=embed_worker.settings)
    summary = await asyncio.wait_for(job_result(handle), 600)
    assert (summary.items_succeeded, summary.items_dead) == (120, 0)
    assert (summary.usage.generated, summary.usage.deduplicated) == (8, 112)
    # The engine's work is counted as a generate job's is: one request per text run.
    assert summary.usage.engine_requests == 8 and summary.usage.gpu_seconds > 0
    found = manifest(summary.manifest, embed_worker.settings)
    out = [line for part in found["output_parts"] for line in jsonl(part)]
    assert sorted(r["item_id"] for r in out) == [r["id"] for r in data]
    title = {r["id"]: r["title"] for r in data}
    by_text: dict[str, list[float]] = {}
    for r in out:
        vector = by_text.setdefault(title[r["item_id"]], r["embedding"])
        assert len(r["embedding"]) == DIM and r["embedding"] == vector
    assert len(by_text) == 8
