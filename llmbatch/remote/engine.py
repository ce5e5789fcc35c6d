"""The remote engine: requests to an OpenAI-compatible endpoint, inside its limits.

The second :class:`~llmbatch.engine.base.BatchEngine`: the ``generate``
activity drives it as it drives the in-process vLLM engine. Each request waits for
the endpoint's shared budget (:mod:`.budget`) and a connection slot
(``max_concurrency`` per worker), then is sent; the answer is classed
(:mod:`.http`): a bad request is that item's dead letter, a context-length error
``PromptTooLong``, 429/5xx/timeouts/dropped connections and unusable 2xx answers are
sent again after a full-jitter backoff (never dead), and a refused key or an unknown
model raises :class:`EndpointRefusedError`, which pauses the job; so do failures that
last (:mod:`.faults`). A 429's wait is capped and shared (:mod:`.budget`).

The endpoint's row is read every second (:mod:`.watch`): changed options (limits,
concurrency, prices, base URL, timeout, key variable) apply to the requests that
follow, and a lifted wait wakes every request that waits.

Delivery to the endpoint is at-least-once (a worker killed with requests in flight
sends them again from the next attempt); results stay exactly-once (the ledger).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from llmbatch import telemetry
from llmbatch.contract.names import shard_of
from llmbatch.contract.spec import SamplingSpec
from llmbatch.contract.states import EndpointFault, ErrorClass
from llmbatch.engine.base import EngineUsage
from llmbatch.engine.errors import EndpointRefusedError
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
from llmbatch.engine.run_loop import run_many
from llmbatch.ledger.db import Database
from llmbatch.remote.budget import Budget
from llmbatch.remote.endpoints import Endpoint, EndpointError
from llmbatch.remote.faults import FaultPolicy, JobFaults
from llmbatch.remote.http import Answer, Transport, Verdict, backoff_s, unusable
from llmbatch.remote.slots import Slots
from llmbatch.remote.tokens import PromptTokens
from llmbatch.remote.usage import Key, UsageBook
from llmbatch.remote.watch import EndpointRow, EndpointWatch

log = logging.getLogger(__name__)

_Res = TypeVar("_Res")


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
        tokens: PromptTokens | None = None,
        on_capped: Callable[[str], Awaitable[None]] | None = None,
        policy: FaultPolicy | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._model = model
        self._transport = transport
        self._kind = kind
        self.tokens = tokens or PromptTokens()
        self.budget = Budget(pool, endpoint.name, rpm=endpoint.rpm, tpm=endpoint.tpm)
        self.usage_book = UsageBook(pool, endpoint, on_capped=on_capped)
        self.policy = policy or FaultPolicy()
        self.faults = JobFaults(endpoint.name, self.policy)
        self._slots = Slots(endpoint.max_concurrency)
        self._watch = EndpointWatch(pool, endpoint.name, self._on_row)
        self._generation: tuple[datetime | None, int] | None = None
        self._stop_observing = telemetry.observe_endpoint(endpoint.name, lambda: self.budget.factor)
        self.weights: str | None = endpoint.weights(model)
        self.gpus = 0
        self.in_flight = 0

    @classmethod
    async def start(
        cls,
        endpoint: Endpoint,
        model: str,
        *,
        pool: Database,
        tokens: PromptTokens | None = None,
        on_capped: Callable[[str], Awaitable[None]] | None = None,
        policy: FaultPolicy | None = None,
    ) -> RemoteEngine:
        """Connect, and check the key and the model with ``GET /v1/models``: a wrong
        key or model fails here, in one line, before any job's item is touched."""
        transport = _transport(endpoint)
        answer = await transport.get("/models")
        if answer.verdict is Verdict.REFUSED:
            await transport.close()
            raise EndpointRefusedError(
                f"endpoint {endpoint.name} refused this worker: {answer.message}"
            )
        try:
            kind = _server_kind(endpoint, model, answer)
        except EndpointRefusedError:
            await transport.close()
            raise
        engine = cls(
            endpoint,
            model,
            pool=pool,
            transport=transport,
            kind=kind or ServerKind(vllm=False),
            tokens=tokens or PromptTokens.for_model(model),
            on_capped=on_capped,
            policy=policy,
        )
        engine.usage_book.start()
        engine._watch.start()
        return engine

    @property
    def model(self) -> str:
        return self._model

    @property
    def default_max_in_flight(self) -> int:
        return self.endpoint.max_concurrency

    async def close(self) -> None:
        self._stop_observing()
        await self._watch.stop()
        await self.usage_book.stop()
        await self.budget.close()
        await self._transport.close()

    # --- the endpoint's row, read every second -------------------------------------

    async def _on_row(self, row: EndpointRow) -> None:
        """What the row says now reaches this worker: a new generation (``endpoint
        update``, ``resume``) lifts the waits held here and starts the fault counts
        again; changed options apply to the requests that follow."""
        lifted = self._generation is not None and row.generation != self._generation
        self._generation = row.generation
        new = row.endpoint
        self.budget.observe(
            rpm=new.rpm,
            tpm=new.tpm,
            factor=row.send_factor,
            blocked_s=row.blocked_s,
            lifted=lifted,
        )
        if lifted:
            self.faults.clear()
        if new.options() != self.endpoint.options():
            await self._reconfigure(new)

    async def _reconfigure(self, new: Endpoint) -> None:
        old, self.endpoint = self.endpoint, new
        self.usage_book.endpoint = new
        self.weights = new.weights(self._model)
        await self._slots.resize(new.max_concurrency)
        moved = ("base_url", "api_key_env", "api_key_file", "timeout_s", "max_concurrency")
        if any(getattr(old, f) != getattr(new, f) for f in moved):
            try:
                transport = _transport(new)
            except EndpointError as exc:  # e.g. the new key variable is not set here
                log.error("endpoint %s: keeping its old connection: %s", new.name, exc)
                return
            previous, self._transport = self._transport, transport
            await previous.retire()
            if old.base_url != new.base_url:
                # Another server: is it vLLM (it takes more than OpenAI's API)?
                kind = _server_kind(new, self._model, await transport.get("/models"), check=False)
                if kind is not None:
                    self._kind = kind
        log.info("endpoint %s: options changed, now %s", new.name, _changed(old, new))

    # --- requests ------------------------------------------------------------------

    async def _send(
        self, path: str, body: dict[str, Any], *, tokens: float, key: Key, usage: EngineUsage | None
    ) -> Answer:
        """Send until the endpoint answers for good: OK, the item's fault, or refused
        (or failing so long that the job must pause: :mod:`.faults`)."""
        attempt = 0
        while True:
            async with self._slots:
                started = time.monotonic()
                await self.budget.acquire(tokens)
                sent = time.monotonic()
                self.in_flight += 1
                if usage is not None:
                    usage._entered()
                try:
                    answer = await self._transport.post(path, body)
                finally:
                    self.in_flight -= 1
                    if usage is not None:
                        usage._left()
            if answer.verdict is Verdict.OK and (broken := _not_an_answer(path, answer.body)):
                answer = unusable(answer.status, broken)
            throttled = answer.verdict is Verdict.THROTTLED
            self.usage_book.sent(
                key,
                throttled=throttled,
                rate_wait_s=sent - started,
                server_s=time.monotonic() - sent,
            )
            if answer.verdict in (Verdict.OK, Verdict.ITEM_DEAD):
                self.faults.answered(key[0])
                return answer
            fault = answer.fault or EndpointFault.CONNECTION_DROPPED
            self.usage_book.failed(key, fault=fault, message=answer.message)
            if answer.verdict is Verdict.REFUSED:
                raise EndpointRefusedError(
                    f"endpoint {self.endpoint.name} refused the request for model "
                    f"{self._model}: {answer.message}"
                )
            if (why := self.faults.failed(key[0], fault, answer.message)) is not None:
                raise EndpointRefusedError(why)
            if throttled:
                # The wait is the endpoint's, shared by every worker and capped; this
                # request then waits for it in acquire (which a lift ends), after a
                # jitter of its own so the waiters do not all go at once.
                wait = backoff_s(attempt)
                await self.budget.throttled(
                    self._shared_wait(answer, wait), reason=self._wait_reason(answer)
                )
            else:
                asked = answer.retry_after_s
                floor = None if asked is None else self.policy.capped_wait(asked)
                wait = backoff_s(attempt, floor_s=floor)
                if attempt == 0 or attempt % 10 == 0:
                    log.warning(
                        "endpoint %s: %s: %s; sending again in %.1f s",
                        self.endpoint.name,
                        fault,
                        answer.message,
                        wait,
                    )
            attempt += 1
            self.usage_book.retried(key, backoff_s=wait, throttled=throttled)
            await self.budget.sleep(wait)

    def _shared_wait(self, answer: Answer, backoff: float) -> float:
        """How long every worker of the endpoint waits after this 429/503: what it asked,
        at most the cap; without an ask, this request's ``backoff``."""
        asked = answer.retry_after_s
        return backoff if asked is None else self.policy.capped_wait(asked)

    def _wait_reason(self, answer: Answer) -> str:
        """Why the endpoint waits, for ``status``: its answer and the wait it asked."""
        asked = answer.retry_after_s
        if asked is None:
            return f"{answer.message} (no Retry-After: backing off)"
        cap = self.policy.max_retry_after_s
        if asked > cap:
            return (
                f"{answer.message} (Retry-After {asked:g} s, cut to {cap:g} s by "
                "LLMBATCH_REMOTE_MAX_RETRY_AFTER_S)"
            )
        return f"{answer.message} (Retry-After {asked:g} s)"

    async def generate(
        self, request: GenerationRequest, *, usage: EngineUsage | None = None
    ) -> GenerationResult:
        started = time.perf_counter()
        prepared = prepare(request.sampling, vllm=False)
        if prepared.schema_error is not None:
            return failed(request, ErrorClass.INVALID_STRUCTURED_OUTPUT, prepared.schema_error)
        payload = request_payload(request, model=self._model, vllm=self._kind.vllm)
        if isinstance(payload, str):
            return failed(request, ErrorClass.INVALID_REQUEST, payload)
        path, body = payload
        estimate = self.tokens.request(request) + request.sampling.max_tokens
        key = usage_key(request.request_id)
        answer = await self._send(path, body, tokens=estimate, key=key, usage=usage)
        if answer.verdict is Verdict.ITEM_DEAD:
            self.budget.correct(estimated=estimate, actual=0)
            return failed(request, answer.error_class or ErrorClass.INVALID_REQUEST, answer.message)
        telemetry.metrics().engine_requests.add(1, {"llmbatch.model": self._model})
        body_out = answer.body if isinstance(answer.body, dict) else {}
        answered = [_choice(c, chat=request.chat) for c in body_out.get("choices") or [{}]]
        text, finish = answered[0]["text"], answered[0]["finish_reason"]
        used = body_out.get("usage") or {}
        prompt_tokens = int(used.get("prompt_tokens") or 0)
        completion_tokens = int(used.get("completion_tokens") or 0)
        self.budget.correct(estimated=estimate, actual=prompt_tokens + completion_tokens)
        self.usage_book.tokens(key, prompt=prompt_tokens, completion=completion_tokens)
        if any(c["finish_reason"] not in ("stop", "length") for c in answered):
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
        if len(answered) > 1 or any("logprobs" in c for c in answered):
            result.choices = answered
        check_structured(result, request.sampling, prepared)
        return result

    async def embed(
        self, request: EmbeddingRequest, *, usage: EngineUsage | None = None
    ) -> EmbeddingResult:
        started = time.perf_counter()
        options = request.options
        body: dict[str, Any] = {"model": self._model, "input": request.token_ids or request.texts}
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
        estimate = (
            sum(len(ids) for ids in request.token_ids)
            if request.token_ids
            else self.tokens.texts(request.texts)
        )
        key = usage_key(request.request_id)
        answer = await self._send("/embeddings", body, tokens=estimate, key=key, usage=usage)
        if answer.verdict is Verdict.ITEM_DEAD:
            self.budget.correct(estimated=estimate, actual=0)
            return embed_failed(
                request, answer.error_class or ErrorClass.INVALID_REQUEST, answer.message
            )
        body_out = answer.body if isinstance(answer.body, dict) else {}
        data = sorted(body_out.get("data") or [], key=lambda d: d.get("index", 0))
        vectors = [struct.pack(f"<{len(d['embedding'])}f", *d["embedding"]) for d in data]
        if len(vectors) != request.inputs:
            return embed_failed(
                request,
                ErrorClass.INVALID_REQUEST,
                f"the endpoint answered {len(vectors)} vectors for {request.inputs} inputs",
            )
        prompt_tokens = int((body_out.get("usage") or {}).get("prompt_tokens") or 0)
        self.budget.correct(estimated=estimate, actual=prompt_tokens)
        self.usage_book.tokens(key, prompt=prompt_tokens, completion=0)
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
        return self._counted(run_many(call, requests, max_in_flight=max_in_flight))

    def embed_many(
        self,
        requests: AsyncIterable[EmbeddingRequest] | Iterable[EmbeddingRequest],
        *,
        max_in_flight: int,
        usage: EngineUsage | None = None,
    ) -> AsyncGenerator[EmbeddingResult, None]:
        call = functools.partial(self.embed, usage=usage)
        return self._counted(run_many(call, requests, max_in_flight=max_in_flight))

    async def _counted(self, results: AsyncGenerator[_Res, None]) -> AsyncGenerator[_Res, None]:
        """``results``, then the figures counted so far into the ledger: the shard's
        summary, written next, reads them from there."""
        try:
            async with contextlib.aclosing(results):
                async for result in results:
                    yield result
        finally:
            with contextlib.suppress(Exception):  # the database away: the loop retries
                await self.usage_book.flush()


def _transport(endpoint: Endpoint) -> Transport:
    return Transport(
        endpoint.base_url,
        api_key=endpoint.api_key(),
        timeout_s=endpoint.timeout_s,
        max_connections=endpoint.max_concurrency,
    )


def _server_kind(
    endpoint: Endpoint, model: str, answer: Answer, *, check: bool = True
) -> ServerKind | None:
    """What ``GET /v1/models`` says of the server (None: it did not say); with
    ``check``, a model it does not serve is refused."""
    if answer.verdict is Verdict.OK and isinstance(answer.body, dict):
        served = answer.body.get("data") or []
        ids = {m.get("id") for m in served if isinstance(m, dict)}
        if check and ids and model not in ids:
            raise EndpointRefusedError(
                f"endpoint {endpoint.name} does not serve model {model} "
                f"(it serves {', '.join(sorted(str(i) for i in ids)[:5])})"
            )
        return ServerKind(
            vllm=any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in served)
        )
    # Not fatal: the endpoint may be away for now; requests retry.
    log.warning("endpoint %s: GET /models: %s", endpoint.name, answer.message)
    return None


def _not_an_answer(path: str, body: Any) -> str | None:
    """Why a 2xx body that is JSON is still no answer to a request to ``path`` (None:
    it is one). What an answer holds beyond its shape is the item's to judge."""
    if not isinstance(body, dict):
        return f"the body is JSON but not an object: {type(body).__name__}"
    field = "data" if path == "/embeddings" else "choices"
    value = body.get(field)
    if not isinstance(value, list) or not value:
        return f"the body has no {field!r} list"
    return None


def _changed(old: Endpoint, new: Endpoint) -> str:
    before, after = old.options(), new.options()
    return ", ".join(f"{k} {after[k]!r}" for k in after if before[k] != after[k]) or "the same"


def usage_key(request_id: str) -> Key:
    """The job and shard a request belongs to: request ids start with the attempt's
    lease, ``<workflow id>/<activity id>#<attempt>:<n>``; a job's shard workflow ids
    are ``<job id>/[redrive-<n>/]shard-<n>`` (job ids hold no "/")."""
    job, _, rest = request_id.partition("/")
    workflow_id = f"{job}/{rest.rsplit('/', 1)[0]}" if "/" in rest else job
    shard = shard_of(workflow_id)
    return job, -1 if shard is None else shard


def request_payload(
    request: GenerationRequest, *, model: str, vllm: bool
) -> tuple[str, dict[str, Any]] | str:
    """The path (under the base URL) and body for ``request``, or why the endpoint
    cannot take it (``vllm``: a vLLM server, which takes more than OpenAI's API)."""
    spec: SamplingSpec = request.sampling
    body: dict[str, Any] = {
        # Every other parameter of the line, as given: the endpoint runs (or refuses)
        # it, as the in-process engine runs it through vLLM's request models.
        **(spec.params or {}),
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
    body["prompt"] = request.prompt if request.prompt is not None else request.prompt_token_ids
    return "/completions", body


def _choice(answered: Any, *, chat: bool) -> dict[str, Any]:
    """One choice of the endpoint's answer, stored as the in-process engine stores it
    (index, text, finish_reason, and logprobs when it carries them)."""
    answered = answered if isinstance(answered, dict) else {}
    text = (answered.get("message") or {}).get("content") if chat else answered.get("text")
    choice: dict[str, Any] = {
        "index": answered.get("index", 0),
        "text": text or "",
        "finish_reason": answered.get("finish_reason"),
    }
    if answered.get("logprobs") is not None:
        choice["logprobs"] = answered["logprobs"]
    return choice
