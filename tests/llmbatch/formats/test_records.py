"""The JSONL records staged between a shard's steps (llmbatch.formats.records)."""

from __future__ import annotations

from llmbatch.contract.spec import SamplingSpec
from llmbatch.contract.states import ErrorClass
from llmbatch.formats.records import StagedRequest, StagedRow, dump_jsonl, load_jsonl


def test_staged_records_round_trip() -> None:
    rows = [
        # Line breaks and non-ASCII inside values stay inside their record.
        StagedRow(item_id="1", ordinal=0, source="in.jsonl:1", fields={"a": "x\ny\r\u2028ü"}),
        StagedRow(
            item_id="2",
            ordinal=1,
            source="in.jsonl:2",
            error_class=ErrorClass.INVALID_ROW,
            error="bad",
        ),
    ]
    data = dump_jsonl(rows)
    assert data.count(b"\n") == 2
    assert list(load_jsonl(data, StagedRow)) == rows
    assert list(load_jsonl(b"\n" + data + b"\n\n", StagedRow)) == rows  # blank lines skipped
    assert dump_jsonl([]) == b""


def test_staged_request_keeps_its_sampling() -> None:
    requests = [
        StagedRequest(
            item_id="1",
            source="s",
            messages=[{"role": "user", "content": "hi"}],
            sampling=SamplingSpec(choice=["a", "b"], max_tokens=2),
        ),
        StagedRequest(item_id="2", source="s", messages=[{"role": "user", "content": "yo"}]),
        # The request key render works out travels with the request to generate.
        StagedRequest(item_id="3", source="s", prompt="once", key="ab" * 32),
    ]
    loaded = list(load_jsonl(dump_jsonl(requests), StagedRequest))
    assert loaded == requests
    assert isinstance(loaded[0].sampling, SamplingSpec) and loaded[2].key == "ab" * 32


def test_equal_staged_options_are_read_as_one_object() -> None:
    # The engine worker finds a spec's prepared sampling by the spec object: the rows of
    # an OpenAI batch file with equal options must share one.
    short, long_ = SamplingSpec(max_tokens=16), SamplingSpec(max_tokens=32)
    requests = [
        StagedRequest(item_id=str(i), source="s", prompt=f"p{i}", sampling=sampling)
        for i, sampling in enumerate([short, long_, short.model_copy(), None, long_])
    ]
    loaded = list(load_jsonl(dump_jsonl(requests), StagedRequest))
    assert loaded == requests
    assert loaded[0].sampling is loaded[2].sampling and loaded[1].sampling is loaded[4].sampling
    assert loaded[0].sampling is not loaded[1].sampling and loaded[3].sampling is None
    # Each read of an object validates its own.
    again = list(load_jsonl(dump_jsonl(requests), StagedRequest))
    assert again[0].sampling == loaded[0].sampling and again[0].sampling is not loaded[0].sampling
