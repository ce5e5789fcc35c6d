"""The vLLM engine adapter: one in-process ``AsyncLLM`` per worker process.

With the rest of :mod:`llmbatch.engine`, the only code that imports vLLM (workflows
never import it). Chat messages are rendered through the model's own chat template
and tokenized here, so the engine gets token ids and a prompt too long for the
context is caught before submission as a per-item error instead of failing the shard.

Error contract of :meth:`Engine.generate`:

- a permanent problem with one item comes back as a :class:`GenerationResult` with
  ``error_class`` set (``InvalidPrompt``, ``PromptTooLong``, ``InvalidRequest``,
  ``InvalidStructuredOutput``); the caller dead-letters the item and goes on;
- ``EngineDeadError`` propagates: the engine is gone and the process must restart;
- anything else unexpected propagates too (a retry may succeed);
- cancelling the awaiting task aborts the request inside the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Iterable,
    Sequence,
)
from typing import Any

import torch
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.pooling_params import PoolingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from llmbatch import telemetry
from llmbatch.contract.spec import SamplingSpec
from llmbatch.contract.states import ErrorClass
from llmbatch.engine.api_requests import choices as api_choices
from llmbatch.engine.base import EngineUsage
from llmbatch.engine.cpu import (
    check_cpu_memory,
    cpu_engine_env,
    cpu_memory_node,
    on_cpu,
    scoped_environ,
)
from llmbatch.engine.options import EngineOptions
from llmbatch.engine.parent_death import children_die_with_us
from llmbatch.engine.requests import (
    EmbeddingRequest,
    EmbeddingResult,
    GenerationRequest,
    GenerationResult,
    Prepared,
    RequestAbortedError,
    check_structured,
    embed_failed,
    failed,
    pooling_params,
    prepare,
    rejected,
)
from llmbatch.engine.run_loop import run_many
from llmbatch.engine.tokens import encoder

# EngineDeadError is re-exported: callers catch it without naming vLLM's module path.
__all__ = ["Engine", "EngineDeadError"]


log = logging.getLogger(__name__)


# Distinct sampling specs whose vLLM params (and JSON schema validator) are kept.
PREPARED_CACHE_SIZE = 256


class Engine:
    """One vLLM engine, shared by every ``generate`` activity of the worker process."""

    def __init__(self, llm: AsyncLLM, tokenizer: Any, options: EngineOptions) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self._tokenize = encoder(tokenizer)
        self.options = options
        self.max_num_seqs: int = llm.vllm_config.scheduler_config.max_num_seqs
        self._max_model_len: int = llm.model_config.max_model_len
        # Bounded: OpenAI batch rows may each bring their own sampling (seed, max_tokens).
        self._prepared: OrderedDict[str, Prepared] = OrderedDict()
        # The same, by the spec object's identity (see _prepare).
        self._prepared_by_id: OrderedDict[tuple[int, bool], tuple[SamplingSpec, Prepared]] = (
            OrderedDict()
        )
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

    @property
    def model(self) -> str:
        """The name jobs call the model by (vLLM's --served-model-name when given)."""
        return self.options.served_name

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
        # ... and die with it, even when it is SIGKILLed (see llmbatch.engine.parent_death).
        with scoped_environ(added), children_die_with_us():
            llm = AsyncLLM.from_engine_args(args)
        # vLLM's own tokenizer: the prompt we count is exactly the prompt it runs.
        engine = cls(llm, llm.get_tokenizer(), options)
        from llmbatch.dedup.keys import weights_fingerprint

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

    def _prepare(self, spec: SamplingSpec, *, chat: bool) -> Prepared:
        # Every request of a shard usually carries the same spec object (the job's
        # sampling): found by identity, without serializing it per request (3.5% of
        # the worker's samples on a chat job). The entry holds the spec, so its id is
        # not reused while the entry lives; specs are not changed after validation
        # (an override builds a new one). Equal specs in other objects (an OpenAI
        # line's own) share one Prepared through the value key.
        mine = self._prepared_by_id.get((id(spec), chat))
        if mine is not None and mine[0] is spec:
            return mine[1]
        key = f"{chat}:{spec.model_dump_json()}"
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepared[key] = prepare(spec, chat=chat)
            if len(self._prepared) > PREPARED_CACHE_SIZE:
                self._prepared.popitem(last=False)
        else:
            self._prepared.move_to_end(key)
        self._prepared_by_id[(id(spec), chat)] = (spec, prepared)
        if len(self._prepared_by_id) > PREPARED_CACHE_SIZE:
            self._prepared_by_id.popitem(last=False)
        return prepared

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids the engine runs for ``request`` (chat template applied)."""
        if request.messages is not None:
            text = self._tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=False
            )
            # The template writes the special tokens (BOS and all) itself.
            return self._tokenize(text, False)
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return self._tokenize(request.prompt or "", True)

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
        prepared = self._prepare(request.sampling, chat=request.chat)
        if prepared.invalid is not None:
            return failed(request, ErrorClass.INVALID_REQUEST, prepared.invalid)
        if prepared.schema_error is not None:
            return failed(request, ErrorClass.INVALID_STRUCTURED_OUTPUT, prepared.schema_error)
        assert prepared.params is not None
        try:
            ids = self.prompt_token_ids(request)
        except Exception as exc:  # a template that cannot render these messages
            return failed(request, ErrorClass.INVALID_PROMPT, f"cannot render the prompt: {exc}")
        if not ids:
            return failed(request, ErrorClass.INVALID_PROMPT, "the prompt is empty")
        keep = request.sampling.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        if len(ids) >= self.max_model_len:
            return failed(
                request,
                ErrorClass.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens; the model's context of {self.max_model_len} "
                "tokens leaves no room to generate (re-drive with truncate_prompt_tokens, "
                "or on a worker with a longer --max-model-len)",
                prompt_tokens=len(ids),
            )
        final = None
        assert prepared.params is not None  # prepared for vLLM (see _prepare)
        self.requests_submitted += 1
        telemetry.metrics().engine_requests.add(1, {"llmbatch.model": self.options.model})
        if usage is not None:
            usage._entered()
        try:
            async for output in self._llm.generate(
                tokens_input(ids), prepared.request_params(), request.request_id
            ):
                final = output
        except asyncio.CancelledError:
            # vLLM aborts on cancellation too, but not if we are cancelled between
            # submission and its first await; aborting an unknown id is a no-op.
            await _abort_quietly(self._llm, request.request_id)
            raise
        except VLLMClientError as exc:  # vLLM's validation of this request
            return rejected(request, exc, prompt_tokens=len(ids))
        except EngineGenerateError as exc:
            # vLLM wraps plain ValueErrors of its request validation in this.
            if isinstance(exc.__cause__, ValueError | TypeError):
                return rejected(request, exc.__cause__, prompt_tokens=len(ids))
            raise
        finally:
            if usage is not None:
                usage._left()
        if final is None or not final.outputs:
            raise RequestAbortedError(f"request {request.request_id}: the engine returned nothing")
        completion = final.outputs[0]
        for candidate in final.outputs:
            if candidate.finish_reason not in ("stop", "length"):
                raise RequestAbortedError(
                    f"request {request.request_id} ended with {candidate.finish_reason!r}"
                )
        result = GenerationResult(
            request_id=request.request_id,
            text=completion.text,
            finish_reason=completion.finish_reason,
            prompt_tokens=len(ids),
            completion_tokens=sum(len(o.token_ids) for o in final.outputs),
            latency_ms=(time.perf_counter() - started) * 1000.0,
        )
        if prepared.detailed:
            result.choices = api_choices(
                final.outputs,
                chat=request.chat,
                tokenizer=self._tokenizer,
                top_logprobs=prepared.params.logprobs,
            )
        check_structured(result, request.sampling, prepared)
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
        given: Sequence[str | list[int]] = request.token_ids or request.texts
        for index, text in enumerate(given):
            # As LLM.embed tokenizes a text prompt (special tokens added), so the
            # vectors are the ones vLLM itself gives for the same text; token ids run
            # as given, as vLLM's server runs them.
            ids = self._tokenize(text, True) if isinstance(text, str) else list(text)
            keep = options.truncate_prompt_tokens
            if keep is not None and len(ids) > keep:
                ids = ids[-keep:]
            if not ids:
                return embed_failed(request, ErrorClass.INVALID_PROMPT, "a text is empty")
            if len(ids) > self.max_model_len:
                which = f"input {index} has" if len(given) > 1 else "the text has"
                return embed_failed(
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
            return embed_failed(request, ErrorClass.INVALID_REQUEST, str(exc))
        except EngineGenerateError as exc:
            if isinstance(exc.__cause__, ValueError | TypeError):
                return embed_failed(request, ErrorClass.INVALID_REQUEST, str(exc.__cause__))
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
        results = run_many(
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
        results = run_many(
            functools.partial(self.generate, usage=usage), requests, max_in_flight=max_in_flight
        )
        async with contextlib.aclosing(results):
            async for result in results:
                yield result


async def _abort_quietly(llm: AsyncLLM, request_id: str) -> None:
    # Shielded: a second cancel must not stop the abort half-way.
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.shield(llm.abort(request_id))
