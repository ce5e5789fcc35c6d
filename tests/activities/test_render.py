"""prepare_shard's rendering on its own: no ledger, no storage."""

from __future__ import annotations

from typing import Any

from activities.render import _render, _templated
from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec, SamplingSpec
from llmbatch.formats.openai_batch import CHAT_COMPLETIONS_URL
from llmbatch.formats.records import StagedRow
from llmbatch.rendering.pool import Rendered
from llmbatch.rendering.templates import PromptTemplate

SPEC = JobSpec(
    job_id="j",
    inputs=["in.jsonl"],
    messages=[ChatMessage(role="user", content="Say {{ x }}")],
    model="m",
    sampling=SamplingSpec(max_tokens=8, choice=["a", "b"]),
    output_uri="out",
)


def row(item_id: str, fields: dict[str, Any]) -> StagedRow:
    return StagedRow(item_id=item_id, ordinal=0, source="in.jsonl:1", fields=fields)


def rendered(spec: JobSpec, fmt: InputFormat, rows: list[StagedRow]) -> dict[int, Rendered]:
    """What the render processes answer, rendered here in-process."""
    template = PromptTemplate(spec.messages) if spec.messages else None
    return {i: template.render(rows[i].fields or {}) for i in _templated(rows, fmt) if template}


def test_job_sampling_is_left_implicit_unless_a_redrive_overrides_it() -> None:
    rows = [row("1", {"x": "hi"})]
    done = rendered(SPEC, InputFormat.JSONL, rows)
    plain, dead = _render(SPEC, InputFormat.JSONL, rows, shard=0, overrides={}, rendered=done)
    assert not dead and plain["1"].sampling is None  # None: the job's own
    assert plain["1"].messages == [{"role": "user", "content": "Say hi"}]
    redriven, _ = _render(
        SPEC, InputFormat.JSONL, rows, shard=0, overrides={"max_tokens": 3}, rendered=done
    )
    assert redriven["1"].sampling == SPEC.sampling.with_overrides({"max_tokens": 3})


def test_a_redrive_overrides_an_openai_requests_own_sampling() -> None:
    spec = SPEC.model_copy(update={"messages": None, "sampling": SamplingSpec()})
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": CHAT_COMPLETIONS_URL,
        "body": {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 50,
            "temperature": 0.7,
        },
    }
    requests, dead = _render(
        spec,
        InputFormat.OPENAI,
        [row("c1", line)],
        shard=0,
        overrides={"max_tokens": 5},
        rendered={},
    )
    assert not dead
    sampling = requests["c1"].sampling
    assert sampling is not None
    assert (sampling.max_tokens, sampling.temperature) == (5, 0.7)
