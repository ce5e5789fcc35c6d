"""``llm-batch worker cpu|gpu|remote``.

The GPU worker's engine options are vLLM's own: every argument of vLLM's engine CLI
(``AsyncEngineArgs.add_cli_args``, as ``vllm serve`` and ``run_batch`` take them) is
passed through and parsed by vLLM's parser, so none is declared again here and a new
vLLM release brings its new arguments with it. vLLM is imported only when a GPU
worker starts or its engine help is asked for: the CLI starts fast, and the CPU
worker's image need not have vLLM.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer

from llmbatch.cli._support.common import fail, runs_temporal_client
from llmbatch.contract.choices import Task

if TYPE_CHECKING:
    from llmbatch.config import Settings

app = typer.Typer(name="worker", help="Run a CPU, GPU or remote worker.", no_args_is_help=True)

ENGINE_ARGS_HELP = (
    "Any vLLM engine argument, spelt as vLLM's CLI spells it, e.g. --max-model-len 4096 "
    "--max-num-seqs 256 --dtype bfloat16 --tensor-parallel-size 2 "
    "--gpu-memory-utilization 0.9 --enable-prefix-caching --quantization awq "
    "--kv-cache-memory-bytes 8G (or --config engine.yaml). Left out: vLLM's default "
    "(on CPU: float32, eager, and a KV cache of 40% of what the engine's memory node has "
    "free; --gpu-memory-utilization is a share of that node there). See them with "
    "--engine-help."
)


DrainTimeout = Annotated[
    float | None,
    typer.Option(
        "--drain-timeout",
        metavar="SECONDS",
        min=0,
        help="On SIGTERM/SIGINT, let work in flight finish this long, then hand the rest "
        "back (a second signal: at once). Default: the drain_timeout setting (25 s, a GKE "
        "spot notice). Keep the pod's terminationGracePeriodSeconds longer.",
        show_default=False,
    ),
]


def _settings(drain_timeout: float | None) -> Settings:
    from llmbatch.config import Settings

    if drain_timeout is None:
        return Settings()
    return Settings(drain_timeout=timedelta(seconds=drain_timeout))


@app.command("cpu")
def cpu(drain_timeout: DrainTimeout = None) -> None:
    """Run the workflows and the CPU activities (read, render, write)."""
    runs_temporal_client()
    from llmbatch.workers import cpu as cpu_worker
    from llmbatch.workers.preflight import StartupCheckFailed
    from llmbatch.workers.shutdown import ConnectionLost

    try:
        cpu_worker.main(_settings(drain_timeout))
    except (StartupCheckFailed, ConnectionLost) as exc:
        raise fail(str(exc)) from None


def _show_engine_help(keyword: str | None) -> None:
    # Eager: answers before --model is asked for.
    if keyword is None:
        return
    from llmbatch.engine.options import engine_args_help

    typer.echo(engine_args_help(keyword))
    raise typer.Exit()


# Unknown options are the engine arguments: Click hands them, with their values, to
# the variadic ``engine_args`` (Click's way to forward options to another parser).
@app.command("gpu", context_settings={"ignore_unknown_options": True})
def gpu(
    model: Annotated[str, typer.Option(help="Hugging Face model id or local path.")],
    engine_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="VLLM_ENGINE_ARGS", help=ENGINE_ARGS_HELP, show_default=False),
    ] = None,
    task: Annotated[
        Task,
        typer.Option(
            help="What the engine serves: generate, or embed (vLLM's pooling runner; add "
            "--convert embed to embed with a decoder model)."
        ),
    ] = Task.GENERATE,
    drain_timeout: DrainTimeout = None,
    concurrent_shards: Annotated[
        int, typer.Option(help="generate activities run at once on this engine.")
    ] = 4,
    max_in_flight: Annotated[
        int | None, typer.Option(help="Requests in flight per activity; default 2 x max_num_seqs.")
    ] = None,
    engine_help: Annotated[
        str | None,
        typer.Option(
            "--engine-help",
            metavar="KEYWORD",
            is_eager=True,
            callback=_show_engine_help,
            help="Show vLLM's engine arguments and exit: 'all', a group (ModelConfig, "
            "CacheConfig, SchedulerConfig, ParallelConfig, ...) or part of a name.",
        ),
    ] = None,
) -> None:
    """Load one vLLM engine and serve ``generate`` (or ``--task embed``) for its model.

    Engine options are vLLM's own engine arguments, given with the options here.
    """
    from llmbatch.workers.preflight import StartupCheckFailed, check_now
    from llmbatch.workers.shutdown import ConnectionLost

    runs_temporal_client()
    settings = _settings(drain_timeout)
    try:
        # Before vLLM is imported (to parse the engine arguments): a bad DSN or S3
        # endpoint fails in a second, not after tens of seconds of imports.
        check_now(settings)
    except StartupCheckFailed as exc:
        raise fail(str(exc)) from None

    from llmbatch.engine.errors import EngineArgumentError
    from llmbatch.engine.options import EngineOptions

    try:
        options = EngineOptions.from_cli_args(model, engine_args or [])
    except EngineArgumentError as exc:
        raise fail(str(exc)) from None

    from llmbatch.engine.cpu import EngineMemoryError
    from llmbatch.workers import gpu as gpu_worker

    try:
        gpu_worker.main(
            settings,
            options,
            max_concurrent_activities=concurrent_shards,
            max_in_flight=max_in_flight,
            task=task,
        )
    except (StartupCheckFailed, ConnectionLost, EngineMemoryError) as exc:
        raise fail(str(exc)) from None


@app.command("remote")
def remote(
    endpoint: Annotated[str, typer.Option(help="The endpoint (llm-batch endpoint add) to call.")],
    model: Annotated[
        list[str] | None,
        typer.Option(help="A model to serve; repeat. Default: every model the endpoint lists."),
    ] = None,
    task: Annotated[Task, typer.Option(help="generate, or embed (/v1/embeddings).")] = (
        Task.GENERATE
    ),
    concurrent_shards: Annotated[
        int, typer.Option(help="generate activities run at once per model.")
    ] = 8,
    max_in_flight: Annotated[
        int | None,
        typer.Option(help="Requests in flight per activity; default the endpoint's concurrency."),
    ] = None,
    drain_timeout: DrainTimeout = None,
) -> None:
    """Serve jobs on a remote OpenAI-compatible endpoint, inside its rate limits.

    The API key is read from the environment variable (or file) the endpoint names.
    """
    from llmbatch.engine.errors import EndpointRefusedError
    from llmbatch.remote.endpoints import EndpointError
    from llmbatch.workers import remote as remote_worker
    from llmbatch.workers.preflight import StartupCheckFailed, check_now
    from llmbatch.workers.shutdown import ConnectionLost

    runs_temporal_client()
    settings = _settings(drain_timeout)
    try:
        check_now(settings)
        remote_worker.main(
            settings,
            endpoint_name=endpoint,
            models=model or [],
            task=task,
            max_concurrent_activities=concurrent_shards,
            max_in_flight=max_in_flight,
        )
    except (
        StartupCheckFailed,
        ConnectionLost,
        EndpointError,
        EndpointRefusedError,
        remote_worker.RemoteWorkerError,
    ) as exc:
        raise fail(str(exc)) from None
