"""The remote engine: requests to an OpenAI-compatible endpoint, inside its limits.

The second :class:`~llmbatch.engine.base.BatchEngine`: the ``generate``
activity drives it as it drives the in-process vLLM engine. Each request waits for
the endpoint's shared budget (:mod:`.budget`) and a connection slot
(``max_concurrency`` per worker), then is sent; the answer is classed
(:mod:`.http`): a bad request is that item's dead letter, a context-length error
``PromptTooLong``, 429/5xx/timeouts/dropped connections are sent again after a
full-jitter backoff (never dead), and a refused key or an unknown model raises
:class:`EndpointRefusedError`, which pauses the job.

Delivery to the endpoint is at-least-once (a worker killed with requests in flight
sends them again from the next attempt); results stay exactly-once (the ledger).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from llmbatch import telemetry
from llmbatch.contract.spec import SamplingSpec
from llmbatch.contract.states import ErrorClass
from llmbatch.engine.base import EngineUsage
from llmbatch.engine.errors import EndpointRefusedError
from llmbatch.engine.options import EngineOptions
from llmbatch.engine.requests import (
    EmbeddingRequest,
    EmbeddingResult,
    GenerationRequest,
    GenerationResult,
    check_structured,
    embed_failed,
    failed,
    prepare,
)
from llmbatch.engine.vllm_engine import _run_many
from llmbatch.ledger.db import Database
from llmbatch.remote.budget import Budget
from llmbatch.remote.endpoints import Endpoint
from llmbatch.remote.http import Answer, Transport, Verdict, backoff_s
from llmbatch.remote.usage import UsageBook

log = logging.getLogger(__name__)

# Without a tokenizer, a prompt's tokens are estimated as characters / 4 (English
# text in BPE vocabularies averages ~4 characters a token), plus a few a message.
CHARS_PER_TOKEN = 4.0
TOKENS_PER_MESSAGE = 4


@dataclass(slots=True)
class ServerKind:
    """What the endpoint is: vLLM's server takes ``structured_outputs`` (choice,
    regex, JSON) and ``truncate_prompt_tokens``; others take OpenAI's
    ``response_format`` only."""

    vllm: bool


class RemoteEngine:
    """One endpoint and model, shared by every ``generate`` activity of the worker."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        *,
        pool: Database,
        transport: Transport,
        kind: ServerKind,
        tokenizer: Any = None,
        on_capped: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._model = model
        # What the generate activity reads of any engine (llmbatch.engine.base): the
        # model it serves; no vLLM engine arguments here.
        self.options = EngineOptions(model=model)
        self._transport = transport
        self._kind = kind
        self._tokenizer = tokenizer
        self.budget = Budget(pool, endpoint.name, rpm=endpoint.rpm, tpm=endpoint.tpm)
        self.usage_book = UsageBook(pool, endpoint, on_capped=on_capped)
        self._slots = asyncio.Semaphore(endpoint.max_concurrency)
        # Answers from the endpoint's model: the cache keys them by endpoint and model
        # (a provider may change what a model name answers: see the docs).
        self.weights: str | None = f"endpoint:{endpoint.base_url}:{model}"
        self.gpus = 0
        self.in_flight = 0

    @classmethod
    async def start(
        cls,
        endpoint: Endpoint,
        model: str,
        *,
        pool: Database,
        tokenizer: Any = None,
        on_capped: Callable[[str], Awaitable[None]] | None = None,
    ) -> RemoteEngine:
        """Connect, and check the key and the model with ``GET /v1/models``: a wrong
        key or model fails here, in one line, before any job's item is touched."""
        transport = Transport(
            endpoint.base_url,
            api_key=endpoint.api_key(),
            timeout_s=endpoint.timeout_s,
            max_connections=endpoint.max_concurrency,
        )
        answer = await transport.get("/models")
        if answer.verdict is Verdict.REFUSED:
            await transport.close()
            raise EndpointRefusedError(
                f"endpoint {endpoint.name} refused this worker: {answer.message}"
            )
        vllm = False
        if answer.verdict is Verdict.OK and isinstance(answer.body, dict):
            served = answer.body.get("data") or []
            ids = {m.get("id") for m in served if isinstance(m, dict)}
            vllm = any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in served)
            if ids and model not in ids:
                await transport.close()
                raise EndpointRefusedError(
                    f"endpoint {endpoint.name} does not serve model {model} "
                    f"(it serves {', '.join(sorted(str(i) for i in ids)[:5])})"
                )
        elif answer.verdict is not Verdict.OK:
            # Not fatal: the endpoint may be away for now; requests retry.
            log.warning("endpoint %s: GET /models: %s", endpoint.name, answer.message)
        engine = cls(
            endpoint,
            model,
            pool=pool,
            transport=transport,
            kind=ServerKind(vllm=vllm),
            tokenizer=tokenizer if tokenizer is not None else _load_tokenizer(model),
            on_capped=on_capped,
        )
        engine.usage_book.start()
        return engine

    @property
    def model(self) -> str:
        return self._model

    @property
    def default_max_in_flight(self) -> int:
        return self.endpoint.max_concurrency

    async def close(self) -> None:
        await self.usage_book.stop()
        await self.budget.close()
        await self._transport.close()

    # --- estimates -----------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt's tokens: the model's tokenizer where it loaded, else chars/4."""
        if self._tokenizer is not None:
            with contextlib.suppress(Exception):
                if request.messages is not None:
                    return len(
                        self._tokenizer.apply_chat_template(
                            request.messages, add_generation_prompt=True, tokenize=True
                        )
                    )
                return len(self._tokenizer.encode(request.prompt or ""))
        if request.messages is not None:
            chars = sum(len(str(m.get("content", ""))) for m in request.messages)
            return int(chars / CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(request.messages)
        return int(len(request.prompt or "") / CHARS_PER_TOKEN) + 1

    def _text_tokens(self, texts: list[str]) -> int:
        if self._tokenizer is not None:
            with contextlib.suppress(Exception):
                return sum(len(self._tokenizer.encode(t)) for t in texts)
        return sum(int(len(t) / CHARS_PER_TOKEN) + 1 for t in texts)

    # --- requests ------------------------------------------------------------------

    async def _send(
        self, path: str, body: dict[str, Any], *, tokens: float, job: str, usage: EngineUsage | None
    ) -> Answer:
        """Send until the endpoint answers for good: OK, the item's fault, or refused."""
        attempt = 0
        while True:
            async with self._slots:
                await self.budget.acquire(tokens)
                self.in_flight += 1
                if usage is not None:
                    usage._entered()
                try:
                    answer = await self._transport.post(path, body)
                finally:
                    self.in_flight -= 1
                    if usage is not None:
                        usage._left()
            self.usage_book.sent(job, throttled=answer.verdict is Verdict.THROTTLED)
            if answer.verdict is Verdict.THROTTLED:
                wait = backoff_s(attempt, floor_s=answer.retry_after_s)
                await self.budget.throttled(answer.retry_after_s or wait)
            elif answer.verdict is Verdict.RETRY:
                wait = backoff_s(attempt, floor_s=answer.retry_after_s)
                if attempt == 0 or attempt % 10 == 0:
                    log.warning(
                        "endpoint %s: %s; sending again in %.1f s",
                        self.endpoint.name,
                        answer.message,
                        wait,
                    )
            elif answer.verdict is Verdict.REFUSED:
                raise EndpointRefusedError(
                    f"endpoint {self.endpoint.name} refused the request for model "
                    f"{self._model}: {answer.message}"
                )
            else:
                return answer
            attempt += 1
            self.usage_book.retried(job)
            await asyncio.sleep(wait)

    async def generate(
        self, request: GenerationRequest, *, usage: EngineUsage | None = None
    ) -> GenerationResult:
        started = time.perf_counter()
        prepared = prepare(request.sampling)
        if prepared.schema_error is not None:
            return failed(request, ErrorClass.INVALID_STRUCTURED_OUTPUT, prepared.schema_error)
        payload = request_payload(request, model=self._model, vllm=self._kind.vllm)
        if isinstance(payload, str):
            return failed(request, ErrorClass.INVALID_REQUEST, payload)
        path, body = payload
        estimate = self.prompt_tokens(request) + request.sampling.max_tokens
        job = job_of(request.request_id)
        answer = await self._send(path, body, tokens=estimate, job=job, usage=usage)
        if answer.verdict is Verdict.ITEM_DEAD:
            self.budget.correct(estimated=estimate, actual=0)
            return failed(request, answer.error_class or ErrorClass.INVALID_REQUEST, answer.message)
        telemetry.metrics().engine_requests.add(1, {"llmbatch.model": self._model})
        body_out = answer.body if isinstance(answer.body, dict) else {}
        choice = (body_out.get("choices") or [{}])[0]
        text = (
            (choice.get("message") or {}).get("content")
            if request.messages is not None
            else choice.get("text")
        ) or ""
        finish = choice.get("finish_reason")
        used = body_out.get("usage") or {}
        prompt_tokens = int(used.get("prompt_tokens") or 0)
        completion_tokens = int(used.get("completion_tokens") or 0)
        self.budget.correct(estimated=estimate, actual=prompt_tokens + completion_tokens)
        self.usage_book.tokens(job, prompt=prompt_tokens, completion=completion_tokens)
        if finish not in ("stop", "length"):
            return failed(
                request,
                ErrorClass.INVALID_REQUEST,
                f"the endpoint ended the answer with finish_reason {finish!r}",
                prompt_tokens=prompt_tokens,
            )
        result = GenerationResult(
            request_id=request.request_id,
            text=text,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_ms=(time.perf_counter() - started) * 1000.0,
        )
        check_structured(result, request.sampling, prepared)
        return result

    async def embed(
        self, request: EmbeddingRequest, *, usage: EngineUsage | None = None
    ) -> EmbeddingResult:
        started = time.perf_counter()
        options = request.options
        body: dict[str, Any] = {"model": self._model, "input": request.texts}
        if options.dimensions is not None:
            body["dimensions"] = options.dimensions
        if options.truncate_prompt_tokens is not None:
            if not self._kind.vllm:
                return embed_failed(
                    request,
                    ErrorClass.INVALID_REQUEST,
                    "truncate_prompt_tokens needs a vLLM server",
                )
            body["truncate_prompt_tokens"] = options.truncate_prompt_tokens
        estimate = self._text_tokens(request.texts)
        job = job_of(request.request_id)
        answer = await self._send("/embeddings", body, tokens=estimate, job=job, usage=usage)
        if answer.verdict is Verdict.ITEM_DEAD:
            self.budget.correct(estimated=estimate, actual=0)
            return embed_failed(
                request, answer.error_class or ErrorClass.INVALID_REQUEST, answer.message
            )
        body_out = answer.body if isinstance(answer.body, dict) else {}
        data = sorted(body_out.get("data") or [], key=lambda d: d.get("index", 0))
        vectors = [struct.pack(f"<{len(d['embedding'])}f", *d["embedding"]) for d in data]
        if len(vectors) != len(request.texts):
            return embed_failed(
                request,
                ErrorClass.INVALID_REQUEST,
                f"the endpoint answered {len(vectors)} vectors for {len(request.texts)} texts",
            )
        prompt_tokens = int((body_out.get("usage") or {}).get("prompt_tokens") or 0)
        self.budget.correct(estimated=estimate, actual=prompt_tokens)
        self.usage_book.tokens(job, prompt=prompt_tokens, completion=0)
        return EmbeddingResult(
            request_id=request.request_id,
            vectors=vectors,
            dimensions=len(vectors[0]) // 4 if vectors else 0,
            prompt_tokens=prompt_tokens,
            latency_ms=(time.perf_counter() - started) * 1000.0,
        )

    def generate_many(
        self,
        requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[GenerationResult, None]:
        # The in-process engine's bounded loop, on this engine's calls.
        call = functools.partial(self.generate, usage=usage)
        return _run_many(call, requests, max_in_flight=max_in_flight)

    def embed_many(
        self,
        requests: AsyncIterable[EmbeddingRequest] | Iterable[EmbeddingRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[EmbeddingResult, None]:
        call = functools.partial(self.embed, usage=usage)
        return _run_many(call, requests, max_in_flight=max_in_flight)


def request_payload(
    request: GenerationRequest, *, model: str, vllm: bool
) -> tuple[str, dict[str, Any]] | str:
    """The path (under the base URL) and body for ``request``, or why the endpoint
    cannot take it (``vllm``: a vLLM server, which takes more than OpenAI's API)."""
    spec: SamplingSpec = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
    }
    if spec.stop:
        body["stop"] = spec.stop
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.truncate_prompt_tokens is not None:
        if not vllm:
            return "truncate_prompt_tokens needs a vLLM server"
        body["truncate_prompt_tokens"] = spec.truncate_prompt_tokens
    if spec.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": spec.json_schema, "strict": True},
        }
    elif spec.choice is not None or spec.regex is not None:
        if not vllm:
            return "choice and regex constraints need a vLLM server (use json_schema)"
        body["structured_outputs"] = (
            {"choice": spec.choice} if spec.choice is not None else {"regex": spec.regex}
        )
    if request.messages is not None:
        body["messages"] = request.messages
        return "/chat/completions", body
    body["prompt"] = request.prompt
    return "/completions", body


def job_of(request_id: str) -> str:
    """The job a request belongs to: request ids start with the attempt's lease,
    ``<workflow id>/<activity id>#<attempt>:<n>``, and a job's shard workflow ids
    start with ``<job id>/`` (job ids hold no "/")."""
    return request_id.split("/", 1)[0]


def _load_tokenizer(model: str) -> Any:
    """The model's tokenizer when it is at hand (a local folder or the local cache;
    nothing is downloaded), else None: prompts are then estimated as chars/4."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # any failure means: estimate
        log.info("no tokenizer for %s (%s): prompt tokens estimated as chars/4", model, exc)
        return None
