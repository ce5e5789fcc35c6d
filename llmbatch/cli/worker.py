"""``llm-batch worker cpu|gpu``."""

from __future__ import annotations

from typing import Annotated

import typer

from llmbatch.config import Settings

app = typer.Typer(no_args_is_help=True)


@app.command("cpu")
def cpu() -> None:
    """Run the workflows and the CPU activities (read, render, write)."""
    from workers import cpu as cpu_worker

    cpu_worker.main(Settings())


@app.command("gpu")
def gpu(
    model: Annotated[str, typer.Option(help="Hugging Face model id or local path.")],
    dtype: Annotated[str | None, typer.Option()] = None,
    max_model_len: Annotated[int | None, typer.Option()] = None,
    max_num_seqs: Annotated[int | None, typer.Option()] = None,
    tensor_parallel_size: Annotated[int, typer.Option()] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option()] = 1,
    enable_prefix_caching: Annotated[bool | None, typer.Option()] = None,
    quantization: Annotated[str | None, typer.Option()] = None,
    gpu_memory_utilization: Annotated[
        float | None, typer.Option(help="Share of GPU memory (of RAM on CPU) for the engine.")
    ] = None,
    enforce_eager: Annotated[bool, typer.Option()] = False,
    seed: Annotated[int, typer.Option()] = 0,
    concurrent_shards: Annotated[
        int, typer.Option(help="generate activities run at once on this engine.")
    ] = 4,
    max_in_flight: Annotated[
        int | None, typer.Option(help="Requests in flight per activity; default 2 x max_num_seqs.")
    ] = None,
) -> None:
    """Load one vLLM engine and serve ``generate`` for its model."""
    from llmbatch.engine import EngineOptions
    from workers import gpu as gpu_worker

    options = EngineOptions(
        model=model,
        dtype=dtype or "auto",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        enable_prefix_caching=enable_prefix_caching,
        quantization=quantization,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        seed=seed,
    )
    gpu_worker.main(
        Settings(),
        options,
        max_concurrent_activities=concurrent_shards,
        max_in_flight=max_in_flight,
    )
