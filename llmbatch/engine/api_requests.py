"""OpenAI request parameters, run as vLLM runs them: an item's sampling built by vLLM's
own request models, and vLLM's outputs written back as OpenAI's choices and logprobs.

An item whose :class:`~llmbatch.contract.spec.SamplingSpec` carries ``params`` (every
OpenAI batch line asking for more than the fields SamplingSpec has) gets its
``SamplingParams`` from ``ChatCompletionRequest`` or ``CompletionRequest`` and their
``to_sampling_params``, as vLLM's server and ``run_batch`` build them: whatever vLLM
runs (penalties, logprobs, logit_bias, top_k, min_p, min_tokens, stop_token_ids, ``n``,
response_format, structured_outputs, ...) runs here, checked by vLLM's own validators.
Only the engine worker imports this (it imports vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import SamplingParams

from llmbatch.contract.spec import SamplingSpec
from llmbatch.errors import LlmBatchError

# vLLM writes a logprob of -inf as this (JSON has no infinity), as OpenAI does.
MIN_LOGPROB = -9999.0


class InvalidParams(LlmBatchError, ValueError):
    """The request's parameters are not ones vLLM runs: the item's InvalidRequest."""


def _fields(model: type[Any]) -> frozenset[str]:
    names = set(model.model_fields)
    names |= {f.alias for f in model.model_fields.values() if f.alias}
    return frozenset(names)


CHAT_FIELDS = _fields(ChatCompletionRequest)
COMPLETION_FIELDS = _fields(CompletionRequest)


def api_sampling_params(spec: SamplingSpec, *, chat: bool) -> SamplingParams:
    """vLLM's sampling parameters for ``spec`` (its fields and its ``params``), built by
    vLLM's chat or completions request model; raise InvalidParams.

    A name neither model declares is refused rather than ignored (vLLM's server would
    drop it silently): the caller asked for something, and a typo must not pass as done.
    """
    model: type[ChatCompletionRequest] | type[CompletionRequest]
    model, fields = (
        (ChatCompletionRequest, CHAT_FIELDS)
        if chat
        else (
            CompletionRequest,
            COMPLETION_FIELDS,
        )
    )
    params = dict(spec.params or {})
    unknown = sorted(set(params) - fields)
    if unknown:
        url = "/v1/chat/completions" if chat else "/v1/completions"
        raise InvalidParams(f"body.{unknown[0]} is not a parameter of {url}")
    body: dict[str, Any] = {
        **params,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "stop": spec.stop or [],
        "seed": spec.seed,
    }
    constraint = _constraint(spec)
    if constraint is not None:
        body["structured_outputs"] = {**(params.get("structured_outputs") or {}), **constraint}
    # The prompt is the engine's to tokenize; the model only needs one to validate.
    if chat:
        body["messages"] = [{"role": "user", "content": "."}]
        body["max_completion_tokens"] = spec.max_tokens
    else:
        body["prompt"] = "."
        body["max_tokens"] = spec.max_tokens
    try:
        request = model.model_validate(body)
        sampling = request.to_sampling_params(spec.max_tokens, {})
    except (ValueError, TypeError, VLLMClientError) as exc:
        raise InvalidParams(_message(exc)) from None
    # to_sampling_params builds for one request; these are shared by every item with
    # this spec, so vLLM must copy them per request as it does its own.
    sampling.skip_clone = False
    return sampling


def _constraint(spec: SamplingSpec) -> dict[str, Any] | None:
    if spec.choice is not None:
        return {"choice": spec.choice}
    if spec.json_schema is not None:
        return {"json": spec.json_schema}
    if spec.regex is not None:
        return {"regex": spec.regex}
    return None


def _message(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            found = errors()
        except Exception:  # not pydantic's
            found = None
        if found:
            parts = []
            for error in found[:3]:
                where = ".".join(str(p) for p in error.get("loc", ()))
                parts.append(f"body.{where}: {error.get('msg')}" if where else error.get("msg"))
            return "; ".join(str(p) for p in parts)
    return str(exc)


def choices(
    outputs: Sequence[Any], *, chat: bool, tokenizer: Any, top_logprobs: int | None
) -> list[dict[str, Any]]:
    """vLLM's completion outputs as stored choices: ``index``, ``text``,
    ``finish_reason`` and, when asked for, ``logprobs`` in the OpenAI shape of the
    endpoint (chat's ``content`` list, or completions' parallel lists)."""
    out = []
    for index, output in enumerate(outputs):
        choice: dict[str, Any] = {
            "index": index,
            "text": output.text,
            "finish_reason": output.finish_reason,
        }
        if output.logprobs is not None:
            ids = list(output.token_ids)
            choice["logprobs"] = (
                _chat_logprobs(ids, output.logprobs, tokenizer, top_logprobs)
                if chat
                else _completion_logprobs(ids, output.logprobs, tokenizer, top_logprobs)
            )
        out.append(choice)
    return out


def _token(token_id: int, logprob: Any, tokenizer: Any) -> str:
    decoded = getattr(logprob, "decoded_token", None)
    return decoded if decoded is not None else str(tokenizer.decode([token_id]))


def _chat_logprobs(ids: list[int], steps: Any, tokenizer: Any, top: int | None) -> dict[str, Any]:
    # As vLLM's chat server writes them (OpenAIServingChat._create_chat_logprobs).
    content = []
    for i, token_id in enumerate(ids):
        step = steps[i] if i < len(steps) else None
        chosen = step.get(token_id) if step else None
        if step is None or chosen is None:
            token = str(tokenizer.decode([token_id]))
            content.append(
                {"token": token, "logprob": MIN_LOGPROB, "bytes": _bytes(token), "top_logprobs": []}
            )
            continue
        token = _token(token_id, chosen, tokenizer)
        content.append(
            {
                "token": token,
                "logprob": max(chosen.logprob, MIN_LOGPROB),
                "bytes": _bytes(token),
                "top_logprobs": [
                    {
                        "token": (t := _token(tid, lp, tokenizer)),
                        "logprob": max(lp.logprob, MIN_LOGPROB),
                        "bytes": _bytes(t),
                    }
                    for n, (tid, lp) in enumerate(step.items())
                    if top == -1 or (top is not None and n < top)
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(
    ids: list[int], steps: Any, tokenizer: Any, top: int | None
) -> dict[str, Any]:
    # As vLLM's completions server writes them (_create_completion_logprobs).
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for i, token_id in enumerate(ids):
        step = steps[i] if i < len(steps) else None
        chosen = step.get(token_id) if step else None
        token = _token(token_id, chosen, tokenizer)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if step is None or chosen is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(max(chosen.logprob, MIN_LOGPROB))
        top_logprobs.append(
            {
                _token(tid, lp, tokenizer): max(lp.logprob, MIN_LOGPROB)
                for n, (tid, lp) in enumerate(step.items())
                if top == -1 or (top is not None and n <= top)
            }
        )
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
