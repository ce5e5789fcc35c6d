"""What a worker's engine is started with: :class:`EngineOptions` (the model and vLLM's
own engine arguments, checked against vLLM's argument parser so a typo is refused
with a suggestion) and the help text of those arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
from collections.abc import (
    Iterable,
    Sequence,
)
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from llmbatch.contract.spec import Task
from llmbatch.engine.cpu import (
    CPU_DTYPE,
    cpu_kv_cache_bytes,
    cpu_memory_node,
    on_cpu,
)
from llmbatch.engine.errors import EngineArgumentError

# AsyncEngineArgs' fields: the names vLLM's engine takes, and all it takes.
ENGINE_ARG_NAMES = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


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

    @property
    def served_name(self) -> str:
        """The name jobs and batches call the model by: vLLM's own ``--served-model-name``
        (its first name) when given, else the model as given. The GPU queue, the
        ``GET /v1/models`` listing and the worker's model check use it, so a model
        loaded from a local path is known by a name, never by the path."""
        named = self.engine_args.get("served_model_name")
        if isinstance(named, str) and named:
            return named
        if isinstance(named, list | tuple) and named and isinstance(named[0], str):
            return named[0]
        return self.model

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
