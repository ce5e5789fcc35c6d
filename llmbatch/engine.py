"""The vLLM engine adapter: one in-process ``AsyncLLM`` per worker process.

The only module that imports vLLM (workflows never import it). Chat messages are
rendered through the model's own chat template and tokenized here, so the engine
gets token ids and a prompt too long for the context is caught before submission
as a per-item error instead of failing the shard.

Error contract of :meth:`Engine.generate`:

- a permanent problem with one item comes back as a :class:`GenerationResult` with
  ``error_class`` set (``InvalidPrompt``, ``PromptTooLong``, ``InvalidRequest``,
  ``InvalidStructuredOutput``); the caller dead-letters the item and goes on;
- ``EngineDeadError`` propagates: the engine is gone and the process must restart;
- anything else unexpected propagates too (a retry may succeed);
- cancelling the awaiting task aborts the request inside the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes.util
import dataclasses
import difflib
import functools
import io
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, NoReturn, Self, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from llmbatch import telemetry
from llmbatch.contract.spec import EmbedSpec, SamplingSpec, Task
from llmbatch.contract.states import ErrorClass

__all__ = [
    "EmbeddingRequest",
    "EmbeddingResult",
    "Engine",
    "EngineArgumentError",
    "EngineDeadError",
    "EngineMemoryError",
    "EngineOptions",
    "EngineUsage",
    "GenerationRequest",
    "GenerationResult",
    "RequestAbortedError",
    "sampling_params",
]

log = logging.getLogger(__name__)

# Error classes of per-item (permanent) failures; they name the dead-letter reason.

# What vLLM uses on CPU when the caller does not say (see EngineOptions).
CPU_DTYPE = "float32"
# On CPU, with neither --kv-cache-memory-bytes nor --gpu-memory-utilization given, the
# KV cache gets this share of what the engine's memory node has free at start (see
# cpu_kv_cache_bytes), within these bounds.
CPU_KV_SHARE = 0.4
CPU_KV_MIN_BYTES = 64 << 20
CPU_KV_MAX_BYTES = 64 << 30
# What an engine process holds on CPU before its KV cache, beside the weights (torch,
# vLLM, oneDNN; 0.68 GiB measured with the tiny model): a --gpu-memory-utilization
# share smaller than this plus the weights leaves the KV cache nothing.
CPU_ENGINE_OVERHEAD_BYTES = 768 << 20

# Distinct sampling specs whose vLLM params (and JSON schema validator) are kept.
PREPARED_CACHE_SIZE = 256


class RequestAbortedError(RuntimeError):
    """vLLM ended a request as aborted or errored though we did not cancel it.

    Not the item's fault, so it is raised (the activity retries) rather than
    returned as a dead item."""


def on_cpu() -> bool:
    """True when vLLM runs on its CPU platform (no GPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_engine_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables to add for an embedding (pooling) engine's processes
    on CPU, so that a long job runs in flat memory (what ``environ`` sets is kept).

    vLLM's CPU linear layers run oneDNN matmuls, one primitive per number of tokens in
    a step; vLLM keeps its own LRU of 32 of them per weight shape, but oneDNN also
    keeps every primitive it creates in its process-wide cache (1024 by default).
    Embedding steps hold a different number of tokens nearly every time, so that
    second cache fills for the whole run: the model-runner process (``VLLM::Worker``)
    of an embed worker grew 2.2 MB per 1,000 rows, linearly (1.27 -> 1.38 GiB from
    20,000 to 60,000 rows, the benchmark's engine options). With the cache off
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``) it grew 1.253 -> 1.282 GiB; what was left
    is glibc malloc fragmentation from creating and dropping primitives, which
    tcmalloc (vLLM's recommended allocator on CPU, preloaded into the engine
    processes when the system has it) takes away: 1.204 -> 1.209 GiB, and as fast.
    In benchmarks/embeddings_vs_run_batch.py (20,000 then 200,000 rows) the model
    runner went 1.23 -> 1.50 GiB (workers +10.6%) before, 1.24 -> 1.27 GiB (+1.5%)
    with both, at the same items/s (890 and 900-940).
    """
    env: dict[str, str] = {}
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in environ:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "0"
    preload = environ.get("LD_PRELOAD", "")
    if "libtcmalloc" not in preload:
        # The library's file name; the dynamic loader finds it as it finds any library.
        tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library(
            "tcmalloc"
        )
        if tcmalloc:
            env["LD_PRELOAD"] = f"{tcmalloc}:{preload}" if preload else tcmalloc
    return env


@contextlib.contextmanager
def _environ(added: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``added`` while the engine's processes start, and as it was
    afterwards: nothing else this process starts later (tests start many) inherits
    them."""
    saved = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in saved.items():
            if os.environ.get(name) != added[name]:
                continue  # changed meanwhile (vLLM sets LD_PRELOAD for its own): theirs
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# AsyncEngineArgs' fields: the names vLLM's engine takes, and all it takes.
ENGINE_ARG_NAMES = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


class EngineArgumentError(ValueError):
    """An engine argument vLLM does not declare, or a value it refuses; one line."""


class EngineOptions(BaseModel):
    """The engine a worker builds: the model, and any of vLLM's own engine arguments.

    ``engine_args`` holds :class:`AsyncEngineArgs` fields by name (``max_model_len``,
    ``max_num_seqs``, ``tensor_parallel_size``, ``quantization``, ...), with the values
    vLLM takes; they are vLLM's declarations, not repeated here. A name vLLM does not
    declare is refused, so a misspelt one fails at once instead of being ignored. An
    argument left out keeps vLLM's default, except on vLLM's CPU platform
    (``current_platform.is_cpu()``), where the defaults are what the CPU build needs:
    dtype ``float32`` when ``auto``, eager mode always (no CUDA graphs there), and
    and, when neither ``kv_cache_memory_bytes`` nor ``gpu_memory_utilization`` is
    given, a KV cache sized from the memory node the engine is bound to
    (:func:`cpu_kv_cache_bytes`). On CPU ``gpu_memory_utilization`` is a share of that
    node's memory (not of the machine's) for the whole engine process, the KV cache
    getting what the process leaves of it; :func:`check_cpu_memory` refuses settings
    vLLM would refuse, in one line, before the model loads.

    The model is a field of its own: llm-batch needs it too (the GPU task queue is
    named after it).
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    engine_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("engine_args")
    @classmethod
    def _declared_by_vllm(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        for name in engine_args:
            if name == "model":
                raise ValueError("give the model as EngineOptions.model (--model), not here")
            if name not in ENGINE_ARG_NAMES:
                raise ValueError(
                    f"{name!r} is not a vLLM engine argument{_did_you_mean(name, ENGINE_ARG_NAMES)}"
                )
        return engine_args

    @classmethod
    def from_cli_args(cls, model: str, argv: Sequence[str]) -> EngineOptions:
        """Options from vLLM engine arguments as its CLI takes them (``--max-model-len
        4096 -tp 2 --enable-prefix-caching --compilation-config.mode 3 ...``).

        Parsed by vLLM's own parser, so every engine argument of the installed vLLM is
        accepted, spelt as vLLM spells it. Only the arguments given are kept (the rest
        keep vLLM's defaults, or the CPU ones). An unknown argument or a bad value is an
        :class:`EngineArgumentError` with a one-line message.
        """
        parser = _engine_arg_parser()
        # Only what is given: with every default suppressed, the namespace holds just
        # the arguments in ``argv`` (the CPU defaults must know what was left out).
        # Per action: parser.set_defaults() would put SUPPRESS itself in the namespace.
        for action in parser._actions:
            if action.dest in ENGINE_ARG_NAMES:
                action.default = argparse.SUPPRESS
        try:
            given = vars(parser.parse_args(list(argv)))
        except EngineArgumentError:
            raise
        except (OSError, ValueError) as exc:  # e.g. --config with a missing or bad file
            raise EngineArgumentError(f"vLLM engine arguments: {exc}") from None
        try:
            return cls(model=model, engine_args=given)
        except ValidationError as exc:
            problems = "; ".join(
                f"{e['loc'][0]}: {e.get('ctx', {}).get('error', e['msg'])}" for e in exc.errors()
            )
            raise EngineArgumentError(f"invalid engine options: {problems}") from None

    def for_task(self, task: Task) -> EngineOptions:
        """These options for a worker of ``task``: an embed worker runs vLLM's pooling
        runner (``runner="pooling"``) unless the caller chose a runner; ``--convert
        embed`` turns a decoder model into an embedding model, and is the caller's."""
        if task is Task.EMBED and "runner" not in self.engine_args:
            return self.model_copy(
                update={"engine_args": {**self.engine_args, "runner": "pooling"}}
            )
        return self

    @property
    def pooling(self) -> bool:
        """Whether the engine runs vLLM's pooling runner (an embed worker's)."""
        return self.engine_args.get("runner") == "pooling"

    def to_engine_args(self) -> AsyncEngineArgs:
        """vLLM's engine arguments: ours, then the ones given, then the CPU defaults."""
        values: dict[str, Any] = {
            "model": self.model,
            # Per-interval stat logging is noise in a worker's log; metrics come from us.
            "disable_log_stats": True,
            # Compact JSON: fewer tokens, and no model can stall in endless whitespace.
            "structured_outputs_config": StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True
            ),
        }
        values.update(self.engine_args)
        if on_cpu():
            if values.get("dtype", "auto") == "auto":
                values["dtype"] = CPU_DTYPE
            values["enforce_eager"] = True
            if values.get("kv_cache_memory_bytes") is None and (
                values.get("gpu_memory_utilization") is None
            ):
                values["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(cpu_memory_node())
        return AsyncEngineArgs(**values)


class EngineMemoryError(EngineArgumentError):
    """The engine's memory settings do not fit the machine; one line naming what was
    asked, what the memory node has and which option to change."""


@dataclass(frozen=True)
class MemoryNode:
    """The memory node vLLM's CPU worker binds its engine to, as vLLM reads it."""

    node: int
    total_bytes: int
    available_bytes: int


def cpu_memory_node() -> MemoryNode:
    """The node of the first CPU the engine may run on, read with vLLM's own helpers:
    vLLM binds the engine's memory there and sizes its share from that node alone (on
    some machines node 0 holds 11 or even 3.6 of 24 GiB)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = int(get_allowed_cpu_list()[0].numa_node)
    info = get_memory_node_info(node)
    return MemoryNode(node, int(info.total_memory), int(info.available_memory))


def cpu_kv_cache_bytes(memory: MemoryNode) -> int:
    """A KV cache that fits ``memory``: a share of what the node has free now, within
    bounds. The rest stays for the engine process itself and for whatever else runs
    on the node (another worker, Postgres)."""
    share = int(memory.available_bytes * CPU_KV_SHARE)
    return max(CPU_KV_MIN_BYTES, min(CPU_KV_MAX_BYTES, share))


def check_cpu_memory(args: AsyncEngineArgs, memory: MemoryNode) -> None:
    """Refuse, in one line, the memory settings vLLM's CPU worker would refuse with a
    traceback after loading the model: a KV cache larger than the node has free, a
    share larger than the node has free, or a share too small to hold the engine
    process and its weights (vLLM's "negative KV cache")."""
    gib = 1 << 30
    node = (
        f"memory node {memory.node} has {memory.available_bytes / gib:.2f} GiB free "
        f"of {memory.total_bytes / gib:.2f} GiB"
    )
    kv = args.kv_cache_memory_bytes
    if kv is not None:
        if kv > memory.available_bytes:
            raise EngineMemoryError(
                f"the engine asks for a {kv / gib:.2f} GiB KV cache (--kv-cache-memory-bytes) "
                f"but {node}: give a smaller --kv-cache-memory-bytes, or leave it out to "
                "size the cache from the node"
            )
        return
    share = float(args.gpu_memory_utilization)
    asked = share * memory.total_bytes
    needed = CPU_ENGINE_OVERHEAD_BYTES + _weights_bytes(args.model)
    if asked > memory.available_bytes:
        problem = "more than the node has free"
    elif asked <= needed:
        problem = (
            f"less than the engine process needs before its KV cache "
            f"(about {needed / gib:.2f} GiB), so no KV cache would fit"
        )
    else:
        return
    raise EngineMemoryError(
        f"--gpu-memory-utilization {share:g} asks for {asked / gib:.2f} GiB on CPU (a share "
        f"of memory node {memory.node}, not of the machine), {problem}; {node}: give "
        "--kv-cache-memory-bytes (e.g. 512M) instead, or leave both out to size the KV "
        "cache from the node"
    )


def _weights_bytes(model: str) -> int:
    """The size of a local model folder's weight files (0 for a hub id: unknown here)."""
    folder = os.path.expanduser(model)
    if not os.path.isdir(folder):
        return 0
    return sum(
        entry.stat().st_size
        for entry in os.scandir(folder)
        if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )


def engine_args_help(keyword: str) -> str:
    """vLLM's own help for its engine arguments: ``all``, one config group (e.g.
    ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``) or the arguments whose name
    contains ``keyword`` (vLLM's ``--help=KEYWORD``)."""
    parser = _engine_arg_parser()
    text = io.StringIO()
    # vLLM prints the help and exits; we want the text.
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        parser.parse_args([f"--help={keyword}"])
    return text.getvalue()


class _EngineArgParser(FlexibleArgumentParser):
    """vLLM's parser, with errors raised as EngineArgumentError (argparse would print
    a usage block and exit 2) and an unknown argument named with a suggestion."""

    def error(self, message: str) -> NoReturn:
        raise EngineArgumentError(f"vLLM engine arguments: {message}")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            raise EngineArgumentError(_unknown_message(extra))
        return parsed, extra


def _engine_arg_parser() -> FlexibleArgumentParser:
    """vLLM's engine arguments, declared by vLLM (as its run_batch and serve use them)."""
    # No abbreviations: vLLM's CLI would take --max-num-seq for --max-num-seqs; here a
    # name is exact, so a misspelt one is refused instead of guessed.
    parser = _EngineArgParser(prog="llm-batch worker gpu --model MODEL", allow_abbrev=False)
    return AsyncEngineArgs.add_cli_args(parser)


def _unknown_message(extra: list[str]) -> str:
    options = [a for a in extra if a.startswith("-")]
    if not options:
        return f"unexpected argument {extra[0]!r} (vLLM engine arguments are options)"
    name = options[0].split("=", 1)[0]
    flags = {"--" + n.replace("_", "-") for n in ENGINE_ARG_NAMES}
    return f"unknown vLLM engine argument {name}{_did_you_mean(name, flags)}"


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


class GenerationRequest(BaseModel):
    """One request: chat ``messages`` (rendered with the model's chat template) or a
    raw ``prompt``, never both. ``request_id`` must be unique among in-flight requests."""

    request_id: str = Field(min_length=1)
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)

    @model_validator(mode="after")
    def _messages_or_prompt(self) -> Self:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self


class EmbeddingRequest(BaseModel):
    """One item of an embed job: its texts (usually one), embedded one vector each."""

    request_id: str = Field(min_length=1)
    texts: list[str] = Field(min_length=1)
    options: EmbedSpec = Field(default_factory=EmbedSpec)


@dataclass(slots=True)
class EmbeddingResult:
    """The outcome of one embedding request; ``error_class`` is None on success.

    ``vectors`` holds each text's vector as little-endian float32 bytes (4 bytes a
    dimension): compact, and what both the staged objects and base64 output want.
    """

    request_id: str
    vectors: list[bytes] = dataclasses.field(default_factory=list)
    dimensions: int = 0
    prompt_tokens: int = 0
    latency_ms: float = 0.0
    error_class: ErrorClass | None = None
    error_message: str | None = None


def pooling_params(options: EmbedSpec) -> PoolingParams:
    """vLLM pooling parameters for an embedding with ``options`` (normalizing is the
    embed pooler's activation)."""
    return PoolingParams(
        task="embed", dimensions=options.dimensions, use_activation=options.normalize
    )


class GenerationResult(BaseModel):
    """The outcome of one request; ``error_class`` is None on success."""

    request_id: str
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" (vLLM's finish reasons)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    parsed: Any = None  # json_schema requests: the parsed, schema-valid object
    error_class: ErrorClass | None = None
    error_message: str | None = None


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    """vLLM sampling parameters for ``spec``; only the final output is returned."""
    structured = None
    if spec.choice is not None:
        structured = StructuredOutputsParams(choice=spec.choice)
    elif spec.json_schema is not None:
        structured = StructuredOutputsParams(json=spec.json_schema)
    elif spec.regex is not None:
        structured = StructuredOutputsParams(regex=spec.regex)
    return SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        max_tokens=spec.max_tokens,
        stop=spec.stop,
        seed=spec.seed,
        structured_outputs=structured,
        # Streaming deltas would cost a Python round trip per token; a batch wants the end.
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What one distinct SamplingSpec needs, built once (most jobs have one spec)."""

    params: SamplingParams
    validator: Any = None  # jsonschema validator for json_schema specs
    schema_error: str | None = None  # the spec's schema is not a valid JSON schema


def _prepare(spec: SamplingSpec) -> _Prepared:
    params = sampling_params(spec)
    if spec.json_schema is None:
        return _Prepared(params)
    from jsonschema import exceptions, validators  # a vLLM dependency

    cls = validators.validator_for(spec.json_schema)
    try:
        cls.check_schema(spec.json_schema)
    except exceptions.SchemaError as exc:
        return _Prepared(params, schema_error=f"json_schema is not a valid JSON schema: {exc}")
    return _Prepared(params, validator=cls(spec.json_schema))


class EngineUsage:
    """What one caller's requests took of the engine: requests submitted to vLLM (not
    those refused before it) and the time at least one of them was in the engine.

    Counted here, at the adapter, so the figure is the engine's work and nothing else.
    """

    def __init__(self) -> None:
        self.requests = 0
        self._in_engine = 0
        self._busy_since = 0.0
        self._busy_s = 0.0

    @property
    def busy_s(self) -> float:
        """Seconds with at least one request of this caller in the engine, until now."""
        running = time.perf_counter() - self._busy_since if self._in_engine else 0.0
        return self._busy_s + running

    def _entered(self) -> None:
        self.requests += 1
        if self._in_engine == 0:
            self._busy_since = time.perf_counter()
        self._in_engine += 1

    def _left(self) -> None:
        self._in_engine -= 1
        if self._in_engine == 0:
            self._busy_s += time.perf_counter() - self._busy_since


class Engine:
    """One vLLM engine, shared by every ``generate`` activity of the worker process."""

    def __init__(self, llm: AsyncLLM, tokenizer: Any, options: EngineOptions) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self.options = options
        self.max_num_seqs: int = llm.vllm_config.scheduler_config.max_num_seqs
        self._max_model_len: int = llm.model_config.max_model_len
        # Bounded: OpenAI batch rows may each bring their own sampling (seed, max_tokens).
        self._prepared: OrderedDict[str, _Prepared] = OrderedDict()
        self._closed = False
        # Requests submitted to vLLM since start (all callers): the engine's own count.
        self.requests_submitted = 0
        # What identifies the loaded weights, for the result cache (None: not cached).
        self.weights: str | None = None
        parallel = llm.vllm_config.parallel_config
        # GPUs one engine occupies: what a price per GPU-hour is multiplied by.
        self.gpus: int = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        # The queue-depth gauge reads the engine on each metric collection.
        self._stop_observing = telemetry.observe_engine_queue(
            options.model, lambda: self.num_unfinished_requests
        )

    @classmethod
    async def start(cls, options: EngineOptions) -> Engine:
        """Build the engine and load the model (paid once per process).

        Blocks the event loop while the model loads (vLLM builds the engine
        synchronously); call it before serving anything. The calling script needs an
        ``if __name__ == "__main__":`` guard: vLLM starts its engine core in a
        spawned process.
        """
        started = time.perf_counter()
        # Measured for the pooling runner only: on generate, single rounds of the
        # throughput benchmark ran 10-20% slower with oneDNN's cache off (decode steps
        # come back to the same sizes, which that cache serves), so it stays as vLLM has it.
        added = cpu_engine_env() if on_cpu() and options.pooling else {}
        if added:
            log.info("environment of the engine processes: %s", added)
        # vLLM starts its engine processes here, from this one: they inherit os.environ.
        args = options.to_engine_args()
        if on_cpu():
            check_cpu_memory(args, cpu_memory_node())
        log.info(
            "KV cache: %s",
            f"{args.kv_cache_memory_bytes / (1 << 30):.2f} GiB"
            if args.kv_cache_memory_bytes is not None
            else f"what a {args.gpu_memory_utilization:g} share of memory leaves",
        )
        with _environ(added):
            llm = AsyncLLM.from_engine_args(args)
        # vLLM's own tokenizer: the prompt we count is exactly the prompt it runs.
        engine = cls(llm, llm.get_tokenizer(), options)
        from llmbatch.dedup import weights_fingerprint

        # Once per worker, next to the model load it is small beside.
        engine.weights = await asyncio.to_thread(
            weights_fingerprint, options.model, revision=options.engine_args.get("revision")
        )
        log.info(
            "vLLM engine for %s ready in %.1f s (max_model_len %d, max_num_seqs %d)",
            options.model,
            time.perf_counter() - started,
            engine.max_model_len,
            engine.max_num_seqs,
        )
        return engine

    @property
    def model(self) -> str:
        """The model loaded, as jobs name it (see llmbatch.engine_interface)."""
        return self.options.model

    @property
    def max_model_len(self) -> int:
        """The context length in tokens (prompt plus generated)."""
        return self._max_model_len

    @property
    def default_max_in_flight(self) -> int:
        """Requests kept in flight per activity: enough to keep the scheduler's queue full."""
        return 2 * self.max_num_seqs

    @property
    def num_unfinished_requests(self) -> int:
        """Requests the engine holds right now (all callers together)."""
        return int(self._llm.get_num_unfinished_requests())

    def shutdown(self) -> None:
        """Stop the engine and its processes. Safe to call twice."""
        if not self._closed:
            self._closed = True
            self._stop_observing()
            self._llm.shutdown()

    def _prepare(self, spec: SamplingSpec) -> _Prepared:
        key = spec.model_dump_json()
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepared[key] = _prepare(spec)
            if len(self._prepared) > PREPARED_CACHE_SIZE:
                self._prepared.popitem(last=False)
        else:
            self._prepared.move_to_end(key)
        return prepared

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids the engine runs for ``request`` (chat template applied)."""
        if request.messages is not None:
            text = self._tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=False
            )
            # The template writes the special tokens (BOS and all) itself.
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return list(self._tokenizer.encode(request.prompt or ""))

    async def generate(
        self, request: GenerationRequest, *, usage: EngineUsage | None = None
    ) -> GenerationResult:
        """Generate one request; see the module docstring for the error contract.

        ``usage``, when given, counts the request if it reaches the engine.

        A prompt is too long when it leaves no room for one generated token
        (``prompt_tokens >= max_model_len``, vLLM's own rule). A prompt that fits but
        leaves less than ``max_tokens`` room still runs: generation stops at the end
        of the context with finish reason ``length``.
        """
        started = time.perf_counter()
        prepared = self._prepare(request.sampling)
        if prepared.schema_error is not None:
            return _failed(request, ErrorClass.INVALID_STRUCTURED_OUTPUT, prepared.schema_error)
        try:
            ids = self.prompt_token_ids(request)
        except Exception as exc:  # a template that cannot render these messages
            return _failed(request, ErrorClass.INVALID_PROMPT, f"cannot render the prompt: {exc}")
        if not ids:
            return _failed(request, ErrorClass.INVALID_PROMPT, "the prompt is empty")
        keep = request.sampling.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        if len(ids) >= self.max_model_len:
            return _failed(
                request,
                ErrorClass.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens; the model's context of {self.max_model_len} "
                "tokens leaves no room to generate (re-drive with truncate_prompt_tokens, "
                "or on a worker with a longer --max-model-len)",
                prompt_tokens=len(ids),
            )
        final = None
        self.requests_submitted += 1
        telemetry.metrics().engine_requests.add(1, {"llmbatch.model": self.options.model})
        if usage is not None:
            usage._entered()
        try:
            async for output in self._llm.generate(
                tokens_input(ids), prepared.params, request.request_id
            ):
                final = output
        except asyncio.CancelledError:
            # vLLM aborts on cancellation too, but not if we are cancelled between
            # submission and its first await; aborting an unknown id is a no-op.
            await _abort_quietly(self._llm, request.request_id)
            raise
        except VLLMClientError as exc:  # vLLM's validation of this request
            return _rejected(request, exc, prompt_tokens=len(ids))
        except EngineGenerateError as exc:
            # vLLM wraps plain ValueErrors of its request validation in this.
            if isinstance(exc.__cause__, ValueError | TypeError):
                return _rejected(request, exc.__cause__, prompt_tokens=len(ids))
            raise
        finally:
            if usage is not None:
                usage._left()
        if final is None or not final.outputs:
            raise RequestAbortedError(f"request {request.request_id}: the engine returned nothing")
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RequestAbortedError(
                f"request {request.request_id} ended with {completion.finish_reason!r}"
            )
        result = GenerationResult(
            request_id=request.request_id,
            text=completion.text,
            finish_reason=completion.finish_reason,
            prompt_tokens=len(ids),
            completion_tokens=len(completion.token_ids),
            latency_ms=(time.perf_counter() - started) * 1000.0,
        )
        _check_structured(result, request.sampling, prepared)
        return result

    async def embed(
        self, request: EmbeddingRequest, *, usage: EngineUsage | None = None
    ) -> EmbeddingResult:
        """Embed one request's texts (an engine request each, run together); the error
        contract is :meth:`generate`'s. A text longer than the context (``tokens >
        max_model_len``: pooling needs no room to generate) is ``PromptTooLong`` unless
        ``truncate_prompt_tokens`` keeps its last N tokens; the whole item dies with it.
        ``usage``, when given, counts each text that reaches the engine.
        """
        started = time.perf_counter()
        options = request.options
        prompts: list[list[int]] = []
        for index, text in enumerate(request.texts):
            # As LLM.embed tokenizes a text prompt (special tokens added), so the
            # vectors are the ones vLLM itself gives for the same text.
            ids = list(self._tokenizer.encode(text))
            keep = options.truncate_prompt_tokens
            if keep is not None and len(ids) > keep:
                ids = ids[-keep:]
            if not ids:
                return _embed_failed(request, ErrorClass.INVALID_PROMPT, "a text is empty")
            if len(ids) > self.max_model_len:
                which = f"input {index} has" if len(request.texts) > 1 else "the text has"
                return _embed_failed(
                    request,
                    ErrorClass.PROMPT_TOO_LONG,
                    f"{which} {len(ids)} tokens, more than the model's context of "
                    f"{self.max_model_len} (re-drive with truncate_prompt_tokens, or on a "
                    "worker with a longer --max-model-len)",
                    prompt_tokens=len(ids),
                )
            prompts.append(ids)
        params = pooling_params(options)
        ids_of = [f"{request.request_id}:{i}" for i in range(len(prompts))]
        try:
            outputs = await asyncio.gather(
                *(
                    self._encode(ids, params, rid, usage)
                    for ids, rid in zip(prompts, ids_of, strict=True)
                )
            )
        except asyncio.CancelledError:
            for rid in ids_of:
                await _abort_quietly(self._llm, rid)
            raise
        except VLLMClientError as exc:  # vLLM's validation (dimensions on a plain model)
            return _embed_failed(request, ErrorClass.INVALID_REQUEST, str(exc))
        except EngineGenerateError as exc:
            if isinstance(exc.__cause__, ValueError | TypeError):
                return _embed_failed(request, ErrorClass.INVALID_REQUEST, str(exc.__cause__))
            raise
        vectors = [
            output.outputs.data.to(dtype=torch.float32).numpy().astype("<f4", copy=False).tobytes()
            for output in outputs
        ]
        return EmbeddingResult(
            request_id=request.request_id,
            vectors=vectors,
            dimensions=len(vectors[0]) // 4,
            prompt_tokens=sum(len(ids) for ids in prompts),
            latency_ms=(time.perf_counter() - started) * 1000.0,
        )

    async def _encode(
        self, ids: list[int], params: PoolingParams, request_id: str, usage: EngineUsage | None
    ) -> Any:
        final = None
        self.requests_submitted += 1
        telemetry.metrics().engine_requests.add(1, {"llmbatch.model": self.options.model})
        if usage is not None:
            usage._entered()
        try:
            async for output in self._llm.encode(tokens_input(ids), params, request_id):
                final = output
        finally:
            if usage is not None:
                usage._left()
        if final is None:
            raise RequestAbortedError(f"request {request_id}: the engine returned nothing")
        return final

    async def embed_many(
        self,
        requests: AsyncIterable[EmbeddingRequest] | Iterable[EmbeddingRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[EmbeddingResult, None]:
        """:meth:`generate_many` for embedding requests: the same bounded, lazy loop."""
        results = _run_many(
            functools.partial(self.embed, usage=usage), requests, max_in_flight=max_in_flight
        )
        async with contextlib.aclosing(results):
            async for result in results:
                yield result

    async def generate_many(
        self,
        requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[GenerationResult, None]:
        """Results in completion order, with at most ``max_in_flight`` requests in the
        engine or waiting to be taken; ``requests`` is read lazily, so memory stays
        bounded whatever its length.

        An exception (``EngineDeadError``, the source's own) ends the iteration. Close
        the iterator (``contextlib.aclosing``) when stopping early: closing, like
        cancelling the consumer inside it, aborts every request still in flight.
        """
        results = _run_many(
            functools.partial(self.generate, usage=usage), requests, max_in_flight=max_in_flight
        )
        async with contextlib.aclosing(results):
            async for result in results:
                yield result


_Req = TypeVar("_Req", bound=BaseModel)
_Res = TypeVar("_Res")


async def _run_many(
    call: Callable[[_Req], Awaitable[_Res]],
    requests: AsyncIterable[_Req] | Iterable[_Req],
    *,
    max_in_flight: int,
) -> AsyncGenerator[_Res, None]:
    """``call`` on each request, ``max_in_flight`` at a time, results in completion
    order: the loop :meth:`Engine.generate_many` and :meth:`Engine.embed_many` share."""
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    # A slot is freed when the consumer takes a result, not when the engine
    # finishes it, so a slow consumer also bounds what piles up in ``done``.
    slots = asyncio.Semaphore(max_in_flight)
    done: asyncio.Queue[_Res | BaseException | _End] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def run(request: _Req) -> None:
        try:
            done.put_nowait(await call(request))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # EngineDeadError and the unexpected
            done.put_nowait(exc)

    def submit(request: _Req) -> None:
        task = asyncio.create_task(
            run(request), name=f"engine {getattr(request, 'request_id', '')}"
        )
        running.add(task)
        task.add_done_callback(running.discard)

    async def feed() -> None:
        count = 0
        try:
            if isinstance(requests, AsyncIterable):
                async for request in requests:
                    await slots.acquire()
                    submit(request)
                    count += 1
            else:
                for request in requests:
                    await slots.acquire()
                    submit(request)
                    count += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the source failed
            done.put_nowait(exc)
        done.put_nowait(_End(count))

    feeder = asyncio.create_task(feed(), name="engine feeder")
    total: int | None = None
    received = 0
    try:
        while total is None or received < total:
            item = await done.get()
            if isinstance(item, _End):
                total = item.count
                continue
            if isinstance(item, BaseException):
                raise item
            received += 1
            slots.release()
            yield item
    finally:
        feeder.cancel()
        for task in running:
            task.cancel()
        # Wait for the aborts, so the engine is free when we return.
        await asyncio.gather(feeder, *running, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class _End:
    count: int


async def _abort_quietly(llm: AsyncLLM, request_id: str) -> None:
    # Shielded: a second cancel must not stop the abort half-way.
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.shield(llm.abort(request_id))


def _check_structured(result: GenerationResult, spec: SamplingSpec, prepared: _Prepared) -> None:
    """Parse json_schema output into ``parsed``; mark output that breaks its constraint."""
    cut = (
        f" (cut off at max_tokens={spec.max_tokens} or the context end; raise max_tokens)"
        if result.finish_reason == "length"
        else ""
    )
    if spec.json_schema is not None:
        try:
            parsed = json.loads(result.text)
        except ValueError as exc:
            result.error_class = ErrorClass.INVALID_STRUCTURED_OUTPUT
            result.error_message = f"output is not valid JSON: {exc}{cut}"
            return
        error = next(iter(prepared.validator.iter_errors(parsed)), None)
        if error is not None:
            result.error_class = ErrorClass.INVALID_STRUCTURED_OUTPUT
            result.error_message = f"output does not match json_schema: {error.message}{cut}"
            return
        result.parsed = parsed
    elif spec.choice is not None and result.text not in spec.choice:
        result.error_class = ErrorClass.INVALID_STRUCTURED_OUTPUT
        result.error_message = f"output {result.text[:100]!r} is not one of choice{cut}"


def _rejected(
    request: GenerationRequest, exc: BaseException, *, prompt_tokens: int
) -> GenerationResult:
    message = str(exc)
    if "maximum model length" in message:
        error_class = ErrorClass.PROMPT_TOO_LONG
    elif _constrained(request.sampling) and any(w in message.lower() for w in _STRUCTURED_WORDS):
        # A schema, regex or choice list the structured-output backend refuses.
        error_class = ErrorClass.INVALID_STRUCTURED_OUTPUT
    else:
        error_class = ErrorClass.INVALID_REQUEST
    return _failed(request, error_class, message, prompt_tokens=prompt_tokens)


_STRUCTURED_WORDS = ("structured", "grammar", "schema", "json", "regex", "choice")


def _constrained(spec: SamplingSpec) -> bool:
    return spec.choice is not None or spec.json_schema is not None or spec.regex is not None


def _failed(
    request: GenerationRequest, error_class: ErrorClass, message: str, *, prompt_tokens: int = 0
) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id,
        prompt_tokens=prompt_tokens,
        error_class=error_class,
        error_message=message,
    )


def _embed_failed(
    request: EmbeddingRequest, error_class: ErrorClass, message: str, *, prompt_tokens: int = 0
) -> EmbeddingResult:
    return EmbeddingResult(
        request_id=request.request_id,
        prompt_tokens=prompt_tokens,
        error_class=error_class,
        error_message=message,
    )
