"""The vLLM engine adapter, on vLLM's CPU build with the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psutil
import pytest
from pydantic import ValidationError
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind

from llmbatch.contract.spec import SamplingSpec
from llmbatch.engine.cpu import (
    CPU_KV_MAX_BYTES,
    CPU_KV_MIN_BYTES,
    CPU_KV_SHARE,
    EngineMemoryError,
    MemoryNode,
    check_cpu_memory,
    cpu_engine_env,
    cpu_kv_cache_bytes,
    cpu_memory_node,
    on_cpu,
)
from llmbatch.engine.errors import EngineArgumentError
from llmbatch.engine.options import EngineOptions, engine_args_help
from llmbatch.engine.requests import GenerationRequest, GenerationResult, sampling_params
from llmbatch.engine.vllm_engine import Engine
from tests.fixtures.model import MAX_MODEL_LEN
from tests.fixtures.worker_processes import maps_tcmalloc

# This process's environment before any engine started in it.
_ENVIRON_AT_IMPORT = dict(os.environ)

CHOICES = ["Healthcare", "Retail", "Other"]
LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["a", "b"]}},
    "required": ["label"],
}

_ids = itertools.count()


def chat(text: str, sampling: SamplingSpec | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"test-{next(_ids)}",
        messages=[{"role": "user", "content": text}],
        sampling=sampling or SamplingSpec(max_tokens=8),
    )


async def collect(
    engine: Engine, requests: list[GenerationRequest], *, max_in_flight: int = 64
) -> list[GenerationResult]:
    return [r async for r in engine.generate_many(requests, max_in_flight=max_in_flight)]


async def until(condition: Callable[[], bool]) -> None:
    # Polling: the engine's request count has no event to wait on.
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


# -- options and mapping (no engine needed) ------------------------------------------


def test_engine_args_pass_only_what_is_set() -> None:
    args = EngineOptions(
        model="m", engine_args={"max_num_seqs": 8, "enable_prefix_caching": False}
    ).to_engine_args()
    assert (args.model, args.max_num_seqs, args.enable_prefix_caching) == ("m", 8, False)
    unset = EngineOptions(model="m").to_engine_args()
    # vLLM's own defaults stay when an option is not given.
    defaults = type(unset)(model="m")
    assert (unset.max_model_len, unset.max_num_seqs, unset.quantization) == (
        defaults.max_model_len,
        defaults.max_num_seqs,
        defaults.quantization,
    )
    assert unset.structured_outputs_config.backend == "xgrammar"


def test_cpu_defaults_apply_only_on_cpu() -> None:
    assert on_cpu()  # these machines have no GPU
    args = EngineOptions(model="m").to_engine_args()
    assert (args.dtype, args.enforce_eager) == ("float32", True)
    # Neither a share nor a size given: a KV cache that fits the engine's memory node.
    # (The node's free memory moves between two reads: compare within bounds.)
    node = cpu_memory_node()
    assert args.kv_cache_memory_bytes is not None
    assert CPU_KV_MIN_BYTES <= args.kv_cache_memory_bytes <= CPU_KV_MAX_BYTES
    assert args.kv_cache_memory_bytes <= max(node.total_bytes * CPU_KV_SHARE, CPU_KV_MIN_BYTES)
    chosen = EngineOptions(
        model="m",
        engine_args={
            "dtype": "bfloat16",
            "gpu_memory_utilization": 0.1,
            "kv_cache_memory_bytes": 1 << 30,
        },
    ).to_engine_args()
    assert (chosen.dtype, chosen.gpu_memory_utilization) == ("bfloat16", 0.1)
    assert chosen.kv_cache_memory_bytes == 1 << 30
    sized = EngineOptions(model="m", engine_args={"kv_cache_memory_bytes": 1 << 30})
    # A KV cache size replaces the memory share: no CPU share is added to it.
    vllm_default = AsyncEngineArgs(model="m").gpu_memory_utilization
    assert sized.to_engine_args().gpu_memory_utilization == vllm_default


def test_cpu_engine_env_turns_off_onednn_cache_and_keeps_what_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr("ctypes.util.find_library", found.get)
    assert cpu_engine_env({}) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
        "LD_PRELOAD": "libtcmalloc_minimal.so.4",
    }
    # Preloaded first, before what the environment preloads already.
    assert cpu_engine_env({"LD_PRELOAD": "/lib/libgomp.so"})["LD_PRELOAD"] == (
        "libtcmalloc_minimal.so.4:/lib/libgomp.so"
    )
    # What the operator set is theirs.
    given = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LD_PRELOAD": "/opt/libtcmalloc.so"}
    assert cpu_engine_env(given) == {}
    # No tcmalloc on the system: glibc malloc, and the cache still off.
    monkeypatch.setattr("ctypes.util.find_library", {}.get)
    assert cpu_engine_env({}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


async def test_a_generate_engine_runs_its_processes_as_vllm_has_them(engine: Engine) -> None:
    """The CPU environment is an embedding engine's (tests/activities/test_embed.py
    checks it there): the session's generate engine's processes run without it, and
    this process, which starts workers, servers and tools for the other tests, keeps
    its own environment."""
    # (vLLM itself puts its libgomp in LD_PRELOAD here, for its own processes.)
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == _ENVIRON_AT_IMPORT.get(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    )
    assert "libtcmalloc" not in os.environ.get("LD_PRELOAD", "")
    processes = [
        p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")
    ]
    assert {p.name() for p in processes} >= {"VLLM::EngineCore", "VLLM::Worker"}
    if "libtcmalloc" not in _ENVIRON_AT_IMPORT.get("LD_PRELOAD", ""):
        assert not any(maps_tcmalloc(p) for p in processes)


def test_options_refuse_what_vllm_does_not_declare() -> None:
    with pytest.raises(ValidationError):
        EngineOptions.model_validate({"model": "m", "max_num_seqs": 4})  # not a field of ours
    with pytest.raises(ValidationError, match="did you mean max_num_seqs"):
        EngineOptions(model="m", engine_args={"max_num_seq": 4})
    with pytest.raises(ValidationError, match="--model"):
        EngineOptions(model="m", engine_args={"model": "other"})


def test_cli_engine_args_are_parsed_by_vllm_and_only_given_ones_kept() -> None:
    options = EngineOptions.from_cli_args(
        "m",
        ["--max-model-len", "1k", "--max_num_seqs", "64", "-tp", "1", "--dtype=float32",
         "--no-enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization", "0.25"],
    )  # fmt: skip
    assert options.engine_args == {
        "max_model_len": 1000,  # vLLM's human-readable integers
        "max_num_seqs": 64,  # underscores as vLLM's parser takes them
        "tensor_parallel_size": 1,
        "dtype": "float32",
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.25,
    }
    assert EngineOptions.from_cli_args("m", []).engine_args == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-sqs", "4"], "unknown vLLM engine argument --max-num-sqs (did you mean "
         "--max-num-seqs?)"),
        # vLLM's own CLI would take an abbreviation; here it is a misspelling.
        (["--max-num-seq", "4"], "unknown vLLM engine argument --max-num-seq (did you mean"),
        (["--max-model-len", "lots"], "argument --max-model-len: invalid"),
        (["--dtype", "float99"], "argument --dtype: invalid choice: 'float99'"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)  # fmt: skip
def test_cli_engine_args_vllm_refuses_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(EngineArgumentError) as error:
        EngineOptions.from_cli_args("m", argv)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_engine_help_is_vllms_own() -> None:
    text = engine_args_help("max-num-seqs")
    assert "--max-num-seqs" in text and "--dtype" not in text


def test_sampling_params_map_the_spec() -> None:
    plain = sampling_params(SamplingSpec(temperature=0.7, top_p=0.9, max_tokens=5, stop=["\n"]))
    assert (plain.temperature, plain.top_p, plain.max_tokens, plain.stop) == (0.7, 0.9, 5, ["\n"])
    assert plain.structured_outputs is None
    assert plain.output_kind == RequestOutputKind.FINAL_ONLY
    assert sampling_params(SamplingSpec(seed=3)).seed == 3
    choice = sampling_params(SamplingSpec(choice=CHOICES)).structured_outputs
    assert choice is not None and choice.choice == CHOICES
    schema = sampling_params(SamplingSpec(json_schema=LABEL_SCHEMA)).structured_outputs
    assert schema is not None and schema.json == LABEL_SCHEMA
    regex = sampling_params(SamplingSpec(regex=r"\d+")).structured_outputs
    assert regex is not None and regex.regex == r"\d+"


def test_a_request_has_messages_or_a_prompt() -> None:
    with pytest.raises(ValidationError):
        GenerationRequest(request_id="x")
    with pytest.raises(ValidationError):
        GenerationRequest(request_id="x", prompt="p", messages=[{"role": "user", "content": "c"}])


# -- generation -------------------------------------------------------------------------


async def test_chat_generates_text_and_counts_tokens(engine: Engine) -> None:
    request = chat("Say hello.", SamplingSpec(max_tokens=5))
    result = await engine.generate(request)
    assert result.error_class is None and result.error_message is None
    assert result.request_id == request.request_id
    assert result.text.strip()
    assert result.prompt_tokens == len(engine.prompt_token_ids(request))
    assert (result.completion_tokens, result.finish_reason) == (5, "length")
    assert result.latency_ms > 0
    # Greedy decoding is repeatable.
    again = await engine.generate(chat("Say hello.", SamplingSpec(max_tokens=5)))
    assert again.text == result.text


async def test_a_raw_prompt_is_generated_without_the_chat_template(engine: Engine) -> None:
    request = GenerationRequest(
        request_id="raw-prompt", prompt="The quick brown", sampling=SamplingSpec(max_tokens=3)
    )
    assert "<|user|>" not in str(engine.prompt_token_ids(request))
    result = await engine.generate(request)
    assert result.error_class is None and result.completion_tokens == 3
    assert result.prompt_tokens == len(engine.prompt_token_ids(request)) < 6


async def test_a_stop_string_ends_generation(engine: Engine) -> None:
    free = await engine.generate(chat("Say hello.", SamplingSpec(max_tokens=6)))
    stop = free.text.strip()[-3:]
    stopped = await engine.generate(chat("Say hello.", SamplingSpec(max_tokens=6, stop=[stop])))
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and len(stopped.text) < len(free.text)


async def test_the_shared_sampling_params_stay_as_built(engine: Engine) -> None:
    # Every request of a spec runs on a copy of its prepared params that vLLM copies
    # only shallowly (Prepared.request_params): what vLLM changes on its copy (the
    # stop token ids it adds the model's end-of-sequence token to) must not reach them.
    assert engine._tokenizer.eos_token_id is not None  # else vLLM adds nothing
    spec = SamplingSpec(max_tokens=4, stop=["zz"])
    results = await collect(engine, [chat(f"Say {i}.", spec) for i in range(8)])
    assert all(r.error_class is None for r in results), results
    assert engine._prepare(spec, chat=True).params == sampling_params(spec)
    # Found again by the spec object, and an equal spec finds the same params.
    assert engine._prepare(spec, chat=True) is engine._prepare(spec.model_copy(), chat=True)


async def test_choice_answers_come_from_the_list(engine: Engine) -> None:
    requests = [
        chat(f"Company number {i}", SamplingSpec(choice=CHOICES, temperature=1.0, seed=i))
        for i in range(50)
    ]
    results = await collect(engine, requests)
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in requests)
    assert all(r.error_class is None and r.text in CHOICES for r in results), results
    assert len({r.text for r in results}) > 1  # sampled, not stuck on one answer


async def test_json_schema_output_is_parsed(engine: Engine) -> None:
    requests = [
        chat(f"row {i}", SamplingSpec(json_schema=LABEL_SCHEMA, temperature=1.0, seed=i))
        for i in range(20)
    ]
    results = await collect(engine, requests)
    for r in results:
        assert r.error_class is None, r
        assert r.parsed == json.loads(r.text)
        assert r.parsed["label"] in ("a", "b")
        assert r.finish_reason == "stop"
    assert {r.parsed["label"] for r in results} == {"a", "b"}


async def test_json_cut_off_by_max_tokens_is_an_item_error(engine: Engine) -> None:
    result = await engine.generate(
        chat("row", SamplingSpec(json_schema=LABEL_SCHEMA, max_tokens=2))
    )
    assert result.error_class == "InvalidStructuredOutput"
    assert "max_tokens=2" in (result.error_message or "")
    assert result.parsed is None and result.finish_reason == "length"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (  # refused by JobSpec now; the engine still must not trust its input
            SamplingSpec.model_construct(
                **{**SamplingSpec().model_dump(), "json_schema": {"type": "nonsense"}}
            ),
            "not a valid JSON schema",
        ),
        (  # valid JSON schema that xgrammar cannot turn into a grammar
            SamplingSpec(json_schema={"type": "integer", "minimum": 5, "maximum": 3}, max_tokens=8),
            "grammar",
        ),
        (SamplingSpec(regex=r"(a)\1"), "grammar"),  # backreferences: not supported
    ],
)
async def test_a_bad_constraint_is_an_item_error(
    engine: Engine, spec: SamplingSpec, reason: str
) -> None:
    result = await engine.generate(chat("row", spec))
    assert result.error_class == "InvalidStructuredOutput"
    assert reason in (result.error_message or "")
    # The engine is unharmed.
    assert (await engine.generate(chat("hi"))).error_class is None


async def test_a_prompt_over_the_context_is_an_item_error(engine: Engine) -> None:
    result = await engine.generate(chat("word " * 2000, SamplingSpec(max_tokens=4)))
    assert result.error_class == "PromptTooLong"
    assert result.prompt_tokens > MAX_MODEL_LEN
    assert str(MAX_MODEL_LEN) in (result.error_message or "")


async def test_the_context_limit_is_exact(engine: Engine) -> None:
    """A prompt of max_model_len - 1 tokens gets one token; max_model_len gets none."""

    def prompt(words: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"limit-{next(_ids)}",
            prompt=" dog" * words,
            sampling=SamplingSpec(max_tokens=50),
        )

    assert len(engine.prompt_token_ids(prompt(10))) == 10  # " dog" is one token
    fits = await engine.generate(prompt(engine.max_model_len - 1))
    assert fits.error_class is None
    assert (fits.completion_tokens, fits.finish_reason) == (1, "length")
    full = await engine.generate(prompt(engine.max_model_len))
    assert (full.error_class, full.prompt_tokens) == ("PromptTooLong", engine.max_model_len)


async def test_an_empty_prompt_is_an_item_error(engine: Engine) -> None:
    request = GenerationRequest(request_id="empty", prompt="")
    assert (await engine.generate(request)).error_class == "InvalidPrompt"


# -- cancellation and streaming -----------------------------------------------------------


async def test_cancelling_generate_aborts_the_request_in_the_engine(engine: Engine) -> None:
    baseline = engine.num_unfinished_requests
    long = chat("Tell a long story.", SamplingSpec(max_tokens=MAX_MODEL_LEN - 20))
    task = asyncio.create_task(engine.generate(long))
    await until(lambda: engine.num_unfinished_requests == baseline + 1)
    started = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_unfinished_requests == baseline  # gone from the engine at once
    assert time.perf_counter() - started < 1.0
    assert (await engine.generate(chat("hi"))).error_class is None


async def test_closing_generate_many_aborts_what_is_in_flight(engine: Engine) -> None:
    baseline = engine.num_unfinished_requests
    quick = chat("first", SamplingSpec(max_tokens=1))
    long = SamplingSpec(max_tokens=400)
    requests = [quick, *(chat(f"long story {i}", long) for i in range(200))]
    results = engine.generate_many(requests, max_in_flight=100)
    first = await anext(results)
    assert (first.request_id, first.error_class) == (quick.request_id, None)
    assert engine.num_unfinished_requests > baseline
    await results.aclose()
    assert engine.num_unfinished_requests == baseline


async def test_generate_many_reads_lazily_and_bounds_what_is_in_flight(engine: Engine) -> None:
    baseline = engine.num_unfinished_requests
    sent: list[str] = []
    got: list[str] = []
    in_flight_seen: list[int] = []

    async def source() -> AsyncIterator[GenerationRequest]:
        for i in range(120):
            request = chat(f"row {i}", SamplingSpec(max_tokens=4))
            sent.append(request.request_id)
            yield request

    async with contextlib.aclosing(engine.generate_many(source(), max_in_flight=16)) as results:
        async for result in results:
            in_flight_seen.append(engine.num_unfinished_requests - baseline)
            # A slot frees when a result is taken, so the source is read at most
            # max_in_flight (+ the one waiting for a slot) ahead of the consumer.
            assert len(sent) - len(got) <= 16 + 1
            got.append(result.request_id)
    assert len(got) == len(set(got)) == 120
    assert set(got) == set(sent)
    assert 1 <= max(in_flight_seen) <= 16
    assert engine.num_unfinished_requests == baseline


async def test_a_failing_source_ends_generate_many_and_aborts(engine: Engine) -> None:
    baseline = engine.num_unfinished_requests

    def source() -> Iterator[GenerationRequest]:
        for i in range(10):
            yield chat(f"row {i}", SamplingSpec(max_tokens=400))
        raise RuntimeError("the input broke")

    with pytest.raises(RuntimeError, match="the input broke"):
        async with contextlib.aclosing(engine.generate_many(source(), max_in_flight=32)) as it:
            async for _ in it:
                pass
    assert engine.num_unfinished_requests == baseline


async def test_throughput_of_short_chat_requests(engine: Engine) -> None:
    """Not a speed assertion: prints the figure for the report."""
    count = 2000
    requests = [chat(f"Write about a dog {i}.", SamplingSpec(max_tokens=16)) for i in range(count)]
    started = time.perf_counter()
    results = await collect(engine, requests, max_in_flight=512)
    elapsed = time.perf_counter() - started
    assert len(results) == count and all(r.error_class is None for r in results)
    tokens = sum(r.completion_tokens for r in results)
    print(
        f"\n{count} short chat requests (16 tokens, 512 in flight) in {elapsed:.2f} s: "
        f"{count / elapsed:.0f} req/s, {tokens / elapsed:.0f} generated tokens/s"
    )


def test_the_cpu_kv_cache_is_a_share_of_the_nodes_free_memory_within_bounds() -> None:
    gib = 1 << 30
    assert cpu_kv_cache_bytes(MemoryNode(0, 11 * gib, 9 * gib)) == int(9 * gib * CPU_KV_SHARE)
    assert cpu_kv_cache_bytes(MemoryNode(0, 1 * gib, 10 << 20)) == CPU_KV_MIN_BYTES
    assert cpu_kv_cache_bytes(MemoryNode(0, 2048 * gib, 1024 * gib)) == CPU_KV_MAX_BYTES


@pytest.mark.parametrize(
    ("engine_args", "says"),
    [
        # What the fresh machine did: 0.05 of an 11 GiB node is less than the engine needs.
        ({"gpu_memory_utilization": 0.05}, "no KV cache would fit"),
        ({"gpu_memory_utilization": 0.95}, "more than the node has free"),
        ({"kv_cache_memory_bytes": 10 << 30}, "give a smaller --kv-cache-memory-bytes"),
    ],
)
def test_memory_settings_that_do_not_fit_the_node_are_refused_in_one_line(
    engine_args: dict[str, Any], says: str
) -> None:
    gib = 1 << 30
    node = MemoryNode(0, 11 * gib, 9 * gib)
    args = EngineOptions(model="m", engine_args=engine_args).to_engine_args()
    with pytest.raises(EngineMemoryError) as refused:
        check_cpu_memory(args, node)
    message = str(refused.value)
    assert says in message and "\n" not in message
    assert "memory node 0 has 9.00 GiB free of 11.00 GiB" in message


def test_memory_settings_that_fit_pass() -> None:
    gib = 1 << 30
    node = MemoryNode(0, 11 * gib, 9 * gib)
    for engine_args in ({"gpu_memory_utilization": 0.3}, {"kv_cache_memory_bytes": 512 << 20}):
        check_cpu_memory(EngineOptions(model="m", engine_args=engine_args).to_engine_args(), node)
