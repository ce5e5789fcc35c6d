"""The render stage on its own: no ledger, no storage."""

from __future__ import annotations

import copy
from typing import Any

from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec, SamplingSpec
from llmbatch.formats.openai_requests import CHAT_COMPLETIONS_URL
from llmbatch.formats.records import StagedRow
from llmbatch.rendering.pool import Rendered
from llmbatch.rendering.templates import PromptTemplate
from llmbatch.stages.render import _key_requests, _render, _templated

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


def test_lines_repeating_a_body_share_its_parse_and_key_and_get_what_each_gets_alone() -> None:
    spec = SPEC.model_copy(update={"messages": None, "sampling": SamplingSpec()})
    messages = [{"role": "user", "content": "hi"}]
    bodies: list[dict[str, Any]] = [
        {"messages": messages, "temperature": 0.5},
        {"temperature": 0.5, "messages": messages},  # the same request, in another order
        {"messages": messages, "temperature": 0.7},
        {"messages": messages, "temperature": None},
        # msgspec writes NaN as null: told apart from the body before all the same.
        {"messages": messages, "temperature": float("nan")},
        {"messages": [{"role": "user"}]},  # dead, each time
    ]
    rows = [
        row(
            f"c{i}",
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": CHAT_COMPLETIONS_URL,
                "body": copy.deepcopy(bodies[i % len(bodies)]),
            },
        )
        for i in range(3 * len(bodies))
    ]

    def outcome(
        rows: list[StagedRow],
    ) -> tuple[dict[str, Any], dict[str, str | None], dict[str, str]]:
        requests, dead = _render(spec, InputFormat.OPENAI, rows, shard=0, overrides={}, rendered={})
        _key_requests(spec, requests)
        keys = {r.item_id: requests[r.item_id].key if r.item_id in requests else None for r in rows}
        return requests, keys, {d.item_id: d.error_message for d in dead}

    together, keys, dead = outcome(rows)
    for r in rows:
        alone, alone_keys, alone_dead = outcome([r])
        assert keys[r.item_id] == alone_keys[r.item_id]
        assert dead.get(r.item_id) == alone_dead.get(r.item_id)
        if r.item_id in alone:
            mine, its = together[r.item_id], alone[r.item_id]
            assert (mine.messages, mine.sampling, mine.key) == (its.messages, its.sampling, its.key)
    assert sorted(dead) == ["c10", "c11", "c16", "c17", "c4", "c5"]  # NaN's and no text's
    assert keys["c0"] == keys["c1"] != keys["c2"]
    # A repeat got its body's parse, not one of its own (c6 repeats c0's body).
    assert together["c6"].messages is together["c0"].messages
