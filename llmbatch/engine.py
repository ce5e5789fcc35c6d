"""The vLLM engine adapter: one in-process ``AsyncLLM`` per worker process.

The only module that imports vLLM (workflows never import it). Requests go in as
token ids rendered through the model's chat template, so a prompt too long for the
context is caught here as a per-item error instead of failing the shard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from pydantic import BaseModel, Field
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from llmbatch.contracts import SamplingSpec

__all__ = [
    "Engine",
    "EngineDeadError",
    "EngineOptions",
    "GenerationRequest",
    "GenerationResult",
    "sampling_params",
]

log = logging.getLogger(__name__)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class EngineOptions(BaseModel):
    """Engine settings passed through to vLLM; ``None`` keeps vLLM's default.

    Without a GPU the defaults change to what vLLM's CPU build needs: float32,
    eager mode, and 30% of RAM for the KV cache (``gpu_memory_utilization`` is a
    share of RAM there).
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_prefix_caching: bool | None = None
    quantization: str | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    seed: int = 0

    def to_engine_args(self) -> AsyncEngineArgs:
        values: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "disable_log_stats": True,
            # Compact JSON: fewer tokens, and no model can stall in an endless indent.
            "structured_outputs_config": StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True
            ),
        }
        for name in (
            "max_model_len",
            "max_num_seqs",
            "enable_prefix_caching",
            "quantization",
            "gpu_memory_utilization",
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if _on_cpu():
            if self.dtype == "auto":
                values["dtype"] = "float32"
            values["enforce_eager"] = True
            values.setdefault("gpu_memory_utilization", 0.3)
        return AsyncEngineArgs(**values)


class GenerationRequest(BaseModel):
    request_id: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)


class GenerationResult(BaseModel):
    request_id: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    parsed: Any = None
    error_class: str | None = None
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


class Engine:
    """One vLLM engine, shared by every ``generate`` activity of the worker process."""

    def __init__(self, llm: AsyncLLM, tokenizer: Any, options: EngineOptions) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self.options = options
        self.max_model_len: int = llm.model_config.max_model_len
        self.max_num_seqs: int = llm.vllm_config.scheduler_config.max_num_seqs
        # Sampling params are built once per distinct spec: most jobs have one.
        self._params: dict[str, SamplingParams] = {}

    @classmethod
    async def start(cls, options: EngineOptions) -> Engine:
        """Build the engine and load the model (paid once per process)."""
        from transformers import AutoTokenizer

        llm = AsyncLLM.from_engine_args(options.to_engine_args())
        tokenizer = AutoTokenizer.from_pretrained(options.model)
        return cls(llm, tokenizer, options)

    @property
    def default_max_in_flight(self) -> int:
        """Requests kept in flight per activity: enough to keep the scheduler's queue full."""
        return 2 * self.max_num_seqs

    def shutdown(self) -> None:
        self._llm.shutdown()

    def _sampling(self, spec: SamplingSpec) -> SamplingParams:
        key = spec.model_dump_json()
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = sampling_params(spec)
        return params

    def _token_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            ids = self._tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=True
            )
            # transformers 5 returns a BatchEncoding-like mapping; 4.x a list.
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self._tokenizer.encode(request.prompt or ""))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one request. Per-item failures come back as ``error_class``; a dead
        engine raises ``EngineDeadError``; cancellation aborts the request in vLLM."""
        started = time.perf_counter()
        try:
            ids = self._token_ids(request)
        except Exception as exc:
            return _failed(request, "InvalidPrompt", f"cannot apply the chat template: {exc}")
        if len(ids) >= self.max_model_len:
            return _failed(
                request,
                "PromptTooLong",
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len}",
            )
        final = None
        try:
            async for output in self._llm.generate(
                {"prompt_token_ids": ids}, self._sampling(request.sampling), request.request_id
            ):
                final = output
        except EngineDeadError:
            raise
        except ValueError as exc:  # vLLM's request validation
            return _failed(request, "InvalidRequest", str(exc))
        if final is None or not final.outputs:
            return _failed(request, "EmptyOutput", "the engine returned no output")
        completion = final.outputs[0]
        result = GenerationResult(
            request_id=request.request_id,
            text=completion.text,
            finish_reason=completion.finish_reason,
            prompt_tokens=len(ids),
            completion_tokens=len(completion.token_ids),
            latency_ms=(time.perf_counter() - started) * 1000.0,
        )
        if request.sampling.json_schema is not None:
            try:
                result.parsed = json.loads(completion.text)
            except ValueError as exc:
                result.error_class = "InvalidStructuredOutput"
                result.error_message = (
                    f"output is not valid JSON ({exc}; finish reason {completion.finish_reason})"
                )
        return result

    async def generate_many(
        self, requests: Iterable[GenerationRequest], *, max_in_flight: int
    ) -> AsyncGenerator[GenerationResult, None]:
        """Results as they finish, with at most ``max_in_flight`` requests in the engine.

        Closing the iterator early (or cancelling its consumer) aborts what is in flight.
        """
        done: asyncio.Queue[GenerationResult | BaseException] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()

        async def run(request: GenerationRequest) -> None:
            try:
                done.put_nowait(await self.generate(request))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # EngineDeadError and the unexpected
                done.put_nowait(exc)

        source = iter(requests)
        exhausted = False
        # Every task hands back exactly one item, so counting (not the task set, whose
        # done-callbacks run late) says when everything is in.
        submitted = received = 0
        try:
            while True:
                while not exhausted and submitted - received < max_in_flight:
                    request = next(source, None)
                    if request is None:
                        exhausted = True
                        break
                    task = asyncio.create_task(run(request))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    submitted += 1
                if received == submitted:
                    return
                item = await done.get()
                received += 1
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)


def _failed(request: GenerationRequest, error_class: str, message: str) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id, error_class=error_class, error_message=message
    )
