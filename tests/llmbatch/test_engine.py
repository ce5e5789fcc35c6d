"""The vLLM engine adapter on vLLM's CPU build with the tiny model."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmbatch.contracts import SamplingSpec
from llmbatch.engine import Engine, GenerationRequest

pytestmark = pytest.mark.slow

CHOICES = ["Healthcare", "Retail", "Other"]


def chat(i: int, text: str, sampling: SamplingSpec) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"t-{time.monotonic_ns()}-{i}",
        messages=[{"role": "user", "content": text}],
        sampling=sampling,
    )


async def collect(engine: Engine, requests: list[GenerationRequest], in_flight: int = 64) -> list:
    return [r async for r in engine.generate_many(requests, max_in_flight=in_flight)]


async def test_chat_generates_text_and_counts_tokens(engine: Engine) -> None:
    result = await engine.generate(chat(0, "Say hello.", SamplingSpec(max_tokens=5)))
    assert result.error_class is None
    assert result.prompt_tokens > 0 and 0 < result.completion_tokens <= 5
    assert result.finish_reason in ("stop", "length")


async def test_choice_constraint_holds_for_every_answer(engine: Engine) -> None:
    sampling = SamplingSpec(choice=CHOICES, temperature=1.0, seed=3, max_tokens=8)
    requests = [chat(i, f"Company number {i}", sampling) for i in range(50)]
    results = await collect(engine, requests)
    assert len(results) == 50
    assert all(r.text in CHOICES and r.error_class is None for r in results)
    assert len({r.request_id for r in results}) == 50


async def test_json_schema_outputs_parse(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["a", "b"]}},
        "required": ["label"],
        "additionalProperties": False,
    }
    sampling = SamplingSpec(json_schema=schema, max_tokens=32)
    results = await collect(engine, [chat(i, f"row {i}", sampling) for i in range(10)])
    assert all(r.parsed["label"] in ("a", "b") for r in results), results


async def test_a_prompt_over_the_context_is_an_item_error(engine: Engine) -> None:
    result = await engine.generate(chat(0, "word " * 2000, SamplingSpec(max_tokens=4)))
    assert result.error_class == "PromptTooLong"
    assert str(engine.max_model_len) in (result.error_message or "")


async def test_closing_early_aborts_what_is_in_flight(engine: Engine) -> None:
    sampling = SamplingSpec(max_tokens=256, temperature=1.0, seed=1)
    requests = [chat(i, f"long story {i}", sampling) for i in range(200)]
    results = engine.generate_many(requests, max_in_flight=100)
    first = await anext(results)
    await results.aclose()  # the remaining requests are aborted in the engine
    assert first.request_id.startswith("t-")
    # The engine is free again: a new request completes promptly.
    quick = await asyncio.wait_for(
        engine.generate(chat(999, "hi", SamplingSpec(max_tokens=2))), timeout=30
    )
    assert quick.error_class is None


async def test_throughput_of_short_requests(engine: Engine) -> None:
    """Not a performance assertion: prints the figure (benchmarks/ compares with peers)."""
    sampling = SamplingSpec(max_tokens=16)
    requests = [chat(i, f"Write about a dog {i}.", sampling) for i in range(1000)]
    started = time.perf_counter()
    results = await collect(engine, requests, in_flight=512)
    elapsed = time.perf_counter() - started
    assert len(results) == 1000
    print(f"1,000 short chat requests in {elapsed:.2f} s: {1000 / elapsed:.0f} req/s")
