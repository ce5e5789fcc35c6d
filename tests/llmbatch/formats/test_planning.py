"""Checking a job's inputs before any work: local files through the real stores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch import storage
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec
from llmbatch.formats import planning
from llmbatch.formats.detection import SNIFF_BYTES

# Roots are not what these tests are about: every local path may be read here.
SETTINGS = Settings(local_roots=[Path("/")])
STORES = storage.stores.Stores(SETTINGS)


def job(path: Path, **overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "job_id": "j",
        "inputs": [str(path)],
        "messages": [ChatMessage(role="user", content="{{ text }}")],
        "model": "m",
        "output_uri": "file:///tmp/unused",
    }
    values.update(overrides)
    return JobSpec.model_validate(values)


def request(custom_id: str, **body: Any) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
        }
    )


def write_empty_parquet(path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty.jsonl", b""),
        ("blank.jsonl", b"\n  \n\n"),
        ("header-only.csv", b"text,id\n"),
        ("header-only-bom.tsv", b"\xef\xbb\xbftext\tid\n\n"),
        ("empty.parquet", None),
    ],
)
def test_input_without_rows_is_refused(tmp_path: Path, name: str, content: bytes | None) -> None:
    path = tmp_path / name
    if content is None:
        write_empty_parquet(path)
    else:
        path.write_bytes(content)
    with pytest.raises(planning.InvalidJobSpec, match=f"^input has no rows: {path}$"):
        planning.inspect_inputs(job(path), STORES, SETTINGS.render_limits)


def test_empty_openai_batch_input_is_refused_as_empty_not_as_promptless(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"")
    with pytest.raises(planning.InvalidJobSpec, match="input has no rows"):
        planning.inspect_inputs(job(path, messages=None), STORES, SETTINGS.render_limits)


def test_one_input_with_rows_among_empty_ones_is_enough(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("text\n")
    (tmp_path / "b.csv").write_text("text\nhello\n")
    info = planning.inspect_inputs(job(tmp_path / "*.csv"), STORES, SETTINGS.render_limits)
    shards = planning.plan(job(tmp_path / "*.csv"), info, STORES)
    assert [s.row_count for s in shards] == [1]


def test_rows_the_head_cannot_settle_are_counted_by_the_plan(tmp_path: Path) -> None:
    # Blank lines past the bytes inspect_inputs reads: only the full scan sees no row.
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n" * (SNIFF_BYTES + 10))
    info = planning.inspect_inputs(job(path), STORES, SETTINGS.render_limits)
    with pytest.raises(planning.InvalidJobSpec, match="input has no rows"):
        planning.plan(job(path), info, STORES)


def test_openai_input_asking_for_unsupported_parameters_is_left_to_its_lines(
    tmp_path: Path,
) -> None:
    # A parameter that cannot run is its line's 400, never the whole job's failure.
    path = tmp_path / "batch.jsonl"
    path.write_text(request("a", stream=True) + "\n" + request("b", frobnicate=True) + "\n")
    info = planning.inspect_inputs(job(path, messages=None), STORES, SETTINGS.render_limits)
    assert info.input_format == "openai"


def test_openai_lines_with_other_faults_are_left_to_the_dead_letters(tmp_path: Path) -> None:
    # A bad line is that line's problem: the rest of the job still runs.
    path = tmp_path / "batch.jsonl"
    bad = json.loads(request("b"))
    bad["url"] = "/v1/embeddings"
    path.write_text(request("a", logit_bias={}) + "\n" + json.dumps(bad) + "\n")
    info = planning.inspect_inputs(job(path, messages=None), STORES, SETTINGS.render_limits)
    assert info.input_format == "openai"


def embedding_request(custom_id: str) -> str:
    body = {"model": "m", "input": "hi"}
    return json.dumps({"custom_id": custom_id, "url": "/v1/embeddings", "body": body})


def test_a_file_of_the_other_task_is_refused_naming_the_task(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_text(embedding_request("a") + "\n" + embedding_request("b") + "\n")
    with pytest.raises(planning.InvalidJobSpec, match=r"line 1: url /v1/embeddings is for embed"):
        planning.inspect_inputs(job(path, messages=None), STORES, SETTINGS.render_limits)
    embed = job(path, messages=None, task="embed")
    assert planning.inspect_inputs(embed, STORES, SETTINGS.render_limits).input_format == "openai"
    chat = tmp_path / "chat.jsonl"
    chat.write_text(request("a") + "\n")
    with pytest.raises(planning.InvalidJobSpec, match="is for generate jobs"):
        planning.inspect_inputs(
            job(chat, messages=None, task="embed"), STORES, SETTINGS.render_limits
        )


def test_an_embed_text_naming_a_missing_field_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"title": "t"}) + "\n")
    spec = job(path, messages=None, task="embed", text="{{ title }} {{ body }}")
    with pytest.raises(planning.InvalidJobSpec, match="body"):
        planning.inspect_inputs(spec, STORES, SETTINGS.render_limits)
