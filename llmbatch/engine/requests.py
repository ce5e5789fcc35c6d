"""What goes into an engine and what comes out: generation and embedding requests and
results, a job's sampling as vLLM's ``SamplingParams`` (prepared once per distinct
spec), and the per-item failures a result carries instead of raising.

vLLM is imported only where its parameters are built, so the remote engine, which
shares the requests and results, does not load vLLM (~10 s, and torch with it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, Field, model_validator

from llmbatch.contract.spec import EmbedSpec, SamplingSpec
from llmbatch.contract.states import ErrorClass
from llmbatch.errors import LlmBatchError

if TYPE_CHECKING:
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams


class RequestAbortedError(LlmBatchError, RuntimeError):
    """vLLM ended a request as aborted or errored though we did not cancel it.

    Not the item's fault, so it is raised (the activity retries) rather than
    returned as a dead item."""


class GenerationRequest(BaseModel):
    """One request: chat ``messages`` (rendered with the model's chat template) or a
    raw ``prompt``, never both. ``request_id`` must be unique among in-flight requests."""

    request_id: str = Field(min_length=1)
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)

    @model_validator(mode="after")
    def _messages_or_prompt(self) -> Self:
        given = [self.messages, self.prompt, self.prompt_token_ids]
        if sum(g is not None for g in given) != 1:
            raise ValueError("give exactly one of messages, prompt and prompt_token_ids")
        return self

    @property
    def chat(self) -> bool:
        """Whether this is a chat request (else a completions one)."""
        return self.messages is not None


class EmbeddingRequest(BaseModel):
    """One item of an embed job: its texts (usually one), embedded one vector each."""

    request_id: str = Field(min_length=1)
    texts: list[str] = Field(default_factory=list)
    # Inputs given as token ids (an OpenAI /v1/embeddings line may send them): one
    # vector per list, instead of texts.
    token_ids: list[list[int]] | None = None
    options: EmbedSpec = Field(default_factory=EmbedSpec)

    @model_validator(mode="after")
    def _texts_or_ids(self) -> Self:
        if bool(self.texts) == bool(self.token_ids):
            raise ValueError("give exactly one of texts and token_ids")
        return self

    @property
    def inputs(self) -> int:
        """How many vectors the request asks for."""
        return len(self.token_ids) if self.token_ids else len(self.texts)


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
    from vllm.pooling_params import PoolingParams

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
    # Every choice (index, text, finish_reason, logprobs) when the request asked for
    # more than one text (``n``) or for logprobs; ``text`` is the first choice's.
    choices: list[dict[str, Any]] | None = None
    error_class: ErrorClass | None = None
    error_message: str | None = None


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    """vLLM sampling parameters for ``spec``; only the final output is returned."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

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
class Prepared:
    """What one distinct SamplingSpec needs, built once (most jobs have one spec)."""

    params: SamplingParams | None  # None: for an engine that is not vLLM
    validator: Any = None  # jsonschema validator for json_schema specs
    schema_error: str | None = None  # the spec's schema is not a valid JSON schema
    # The spec's ``params`` are not ones vLLM runs (then ``params`` is None).
    invalid: str | None = None
    # The fields of ``params`` holding a list, set or dict (see request_params).
    _containers: tuple[str, ...] = dataclasses.field(init=False, default=())

    def __post_init__(self) -> None:
        if self.params is not None:
            names = tuple(
                name
                for name in self.params.__struct_fields__
                if isinstance(getattr(self.params, name), list | set | dict)
            )
            object.__setattr__(self, "_containers", names)

    def request_params(self) -> SamplingParams:
        """``params`` for one request: a copy whose lists, sets and dicts are its own,
        marked so that vLLM copies it shallowly instead of deep-copying it.

        vLLM copies the params of every request before it changes them (its
        ``clone``); the deep copy was 5% of the worker's samples on a chat job. What
        vLLM changes after that copy is attributes and the top-level sets and lists
        (the stop token ids); what it changes in nested objects (the structured-output
        backend) it changes before copying, on the object it is given. So a copy with
        its own containers keeps ``params`` as built, as the deep copy did."""
        assert self.params is not None
        copied = copy.copy(self.params)
        for name in self._containers:
            setattr(copied, name, copy.copy(getattr(self.params, name)))
        copied.skip_clone = True
        return copied

    @property
    def detailed(self) -> bool:
        """Whether results carry every choice (``n`` > 1, or logprobs asked for)."""
        return self.params is not None and (self.params.n > 1 or self.params.logprobs is not None)


def prepare(spec: SamplingSpec, *, chat: bool = True, vllm: bool = True) -> Prepared:
    """The spec's checks and, with ``vllm``, its vLLM parameters for a chat (else a
    completions) request: built by vLLM's request models when the spec carries
    ``params`` (see :mod:`llmbatch.engine.api_requests`), else directly from its
    fields. Without ``vllm`` (an engine that is not vLLM) nothing of vLLM is imported."""
    params: SamplingParams | None = None
    if vllm and spec.params:
        # Imported on first use: vLLM's OpenAI protocol modules are a second or more of
        # imports that a worker whose jobs never carry params does not need.
        from llmbatch.engine.api_requests import InvalidParams, api_sampling_params

        try:
            params = api_sampling_params(spec, chat=chat)
        except InvalidParams as exc:
            return Prepared(None, invalid=str(exc))
    elif vllm:
        params = sampling_params(spec)
    if spec.json_schema is None:
        return Prepared(params)
    from jsonschema import exceptions, validators  # a vLLM dependency

    cls = validators.validator_for(spec.json_schema)
    try:
        cls.check_schema(spec.json_schema)
    except exceptions.SchemaError as exc:
        return Prepared(params, schema_error=f"json_schema is not a valid JSON schema: {exc}")
    return Prepared(params, validator=cls(spec.json_schema))


def check_structured(result: GenerationResult, spec: SamplingSpec, prepared: Prepared) -> None:
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


def rejected(
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
    return failed(request, error_class, message, prompt_tokens=prompt_tokens)


_STRUCTURED_WORDS = ("structured", "grammar", "schema", "json", "regex", "choice")


def _constrained(spec: SamplingSpec) -> bool:
    return spec.choice is not None or spec.json_schema is not None or spec.regex is not None


def failed(
    request: GenerationRequest, error_class: ErrorClass, message: str, *, prompt_tokens: int = 0
) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id,
        prompt_tokens=prompt_tokens,
        error_class=error_class,
        error_message=message,
    )


def embed_failed(
    request: EmbeddingRequest, error_class: ErrorClass, message: str, *, prompt_tokens: int = 0
) -> EmbeddingResult:
    return EmbeddingResult(
        request_id=request.request_id,
        prompt_tokens=prompt_tokens,
        error_class=error_class,
        error_message=message,
    )
