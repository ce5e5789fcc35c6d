from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.common import Priority

from llmbatch.contract.priority import describe, task_priority
from llmbatch.contract.spec import EmbedSpec, JobSpec, SamplingSpec


def spec(**overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "job_id": "j1",
        "inputs": ["s3://b/in.csv"],
        "messages": [{"role": "user", "content": "{{ x }}"}],
        "model": "m",
        "output_uri": "s3://b/out",
    }
    values.update(overrides)
    return JobSpec.model_validate(values)


def test_a_minimal_spec_has_working_defaults() -> None:
    s = spec()
    # No shard_size: shards grow (llmbatch.formats.shards.shard_rows).
    assert s.sampling.temperature == 0.0 and s.shard_size is None
    assert s.output_format == "jsonl"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"job_id": "bad id!"}, "job_id"),
        ({"job_id": "a/shard-1"}, "job_id"),
        ({"job_id": "x" * 129}, "job_id"),
        ({"inputs": []}, "inputs"),
        ({"shard_size": 0}, "shard_size"),
        ({"messages": None}, "messages are required"),
        ({"sampling": {"choice": ["a"], "regex": "a"}}, "at most one"),
        ({"sampling": {"regex": "("}}, "regex does not compile"),
        ({"sampling": {"choice": ["a", "a"]}}, "duplicate"),
        ({"sampling": {"temprature": 1}}, "temprature"),
        ({"input_format": "openai"}, "carries its own messages"),
        ({"output_uri": "file:///x/../../y"}, "output URI 'file:///x/../../y' has a '..'"),
        ({"output_uri": "out/.."}, "has a '..' segment"),
        ({"output_uri": "s3://b/a/../../c"}, "has a '..' segment"),
        ({"output_uri": "gs://b/out"}, "unsupported scheme 'gs'"),
        ({"output_uri": "http://host/out"}, "unsupported scheme 'http'"),
        ({"inputs": ["/data/../etc/os-release"]}, "input URI .* has a '..' segment"),
        ({"inputs": ["s3://b/in/../x.csv"]}, "has a '..' segment"),
        ({"sampling": {"json_schema": {"type": "objekt"}}}, "not a valid JSON Schema.*at type"),
        (
            {"sampling": {"json_schema": {"properties": {"a": {"type": 12}}}}},
            "at properties/a/type",
        ),
        ({"sampling": {"json_schema": {"required": "a"}}}, "not a valid JSON Schema"),
        ({"priority": 0}, "priority"),
        ({"priority": 6}, "priority"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "team a"}, "tenant"),
        ({"tenant": "t" * 65}, "tenant"),
        ({"tenant": "a", "tenant_weight": 0}, "tenant_weight"),
        ({"tenant": "a", "tenant_weight": 1001}, "tenant_weight"),
        ({"tenant_weight": 2}, "tenant_weight needs a tenant"),
    ],
)
def test_bad_specs_are_refused_naming_the_problem(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**overrides)


@pytest.mark.parametrize("name", ["batch.jsonl", "batch.NDJSON", "b.jsonlines", "b-*"])
def test_openai_batch_input_needs_no_messages(name: str) -> None:
    # Every name format detection takes for JSON lines (OpenAI batch input among them).
    s = spec(inputs=[f"s3://b/{name}"], messages=None)
    assert s.messages is None


def test_json_schema_is_exported() -> None:
    schema = JobSpec.model_json_schema()
    assert {"inputs", "model", "output_uri"} <= set(schema["required"])
    # Left out, the job id is the workflow id (how each scheduled run gets its own).
    assert "job_id" not in schema["required"]
    assert "SamplingSpec" in schema["$defs"]
    assert SamplingSpec().max_tokens == 256


def test_job_id_may_be_left_out_or_be_a_scheduled_run_id() -> None:
    assert spec(job_id=None).job_id == ""
    assert spec(job_id="").job_id == ""
    # A Temporal Schedule names its runs "<workflow id>-<RFC 3339 UTC time>".
    assert spec(job_id="nightly-2025-06-01T02:00:00Z").job_id == "nightly-2025-06-01T02:00:00Z"


def test_sampling_overrides_win_and_are_validated_as_a_whole() -> None:
    base = SamplingSpec(temperature=0.5, max_tokens=10, choice=["a", "b"])
    assert base.with_overrides({}) is base
    merged = base.with_overrides({"max_tokens": 20, "seed": 7})
    assert (merged.temperature, merged.max_tokens, merged.seed) == (0.5, 20, 7)
    assert merged.choice == ["a", "b"] and base.max_tokens == 10  # base unchanged
    # Swapping the constraint takes clearing the old one, else two are set.
    assert base.with_overrides({"choice": None, "regex": "x+"}).regex == "x+"
    with pytest.raises(ValidationError, match="at most one"):
        base.with_overrides({"regex": "x+"})
    with pytest.raises(ValidationError, match="temprature"):
        base.with_overrides({"temprature": 1})


@pytest.mark.parametrize(
    "output", ["s3://b/out", "S3://b/out", "file:///data/out", "/data/out", "out", "a..b/c.."]
)
def test_outputs_in_a_supported_scheme_without_parent_segments_are_taken(output: str) -> None:
    assert spec(output_uri=output).output_uri == output


def test_a_valid_json_schema_is_kept_as_given() -> None:
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["a", "b"]}, "score": {"type": "number"}},
        "required": ["label"],
    }
    assert spec(sampling={"json_schema": schema}).sampling.json_schema == schema


def test_priority_and_tenant_become_temporal_priority() -> None:
    """The spec's fields map one to one onto Temporal's Priority; left out, nothing is
    set (Temporal's defaults, and the options jobs had before the fields existed)."""
    placed = spec(priority=1, tenant="eval-team@research/nlp", tenant_weight=2.5)
    assert task_priority(placed) == Priority(
        priority_key=1, fairness_key="eval-team@research/nlp", fairness_weight=2.5
    )
    assert describe(placed) == "priority 1, tenant eval-team@research/nlp (weight 2.5)"
    assert task_priority(spec()) == Priority.default
    assert describe(spec()) == ""
    assert task_priority(spec(priority=5)) == Priority(priority_key=5)


def embed(**overrides: Any) -> JobSpec:
    return spec(**{"task": "embed", "messages": None, "text": "{{ x }}", **overrides})


def test_an_embed_job_renders_its_text_as_one_message_with_default_options() -> None:
    s = embed()
    assert s.task == "embed" and s.embed_options.normalize is True
    assert [m.model_dump() for m in s.template_messages() or []] == [
        {"role": "user", "content": "{{ x }}"}
    ]
    assert embed(text=None, inputs=["s3://b/batch.jsonl"]).template_messages() is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"messages": [{"role": "user", "content": "{{ x }}"}]}, "'messages'"),
        ({"sampling": {"max_tokens": 5}}, "'sampling'"),
        ({"text": None}, "'text' is required"),
        ({"input_format": "openai"}, "drop 'text'"),
        ({"embedding": {"dimensions": 0}}, "dimensions"),
    ],
)
def test_bad_embed_combinations_are_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        embed(**overrides)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"text": "{{ x }}"}, "'text'"), ({"embedding": {"normalize": False}}, "'embedding'")],
)
def test_embed_options_on_a_generate_job_are_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        spec(**overrides)


def test_a_redrive_overrides_the_options_of_the_jobs_own_task() -> None:
    options = embed(embedding={"dimensions": 64}).options_with(
        {"normalize": False, "truncate_prompt_tokens": 8}
    )
    assert options == EmbedSpec(dimensions=64, normalize=False, truncate_prompt_tokens=8)
    assert spec().options_with({"max_tokens": 5}) == SamplingSpec(max_tokens=5)
    with pytest.raises(ValidationError, match="temperature"):
        embed().options_with({"temperature": 1})
    with pytest.raises(ValidationError, match="normalize"):
        spec().options_with({"normalize": False})
