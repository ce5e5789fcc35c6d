"""``llm-batch demo``: the README's first command, a real job end to end."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmbatch.cli._support.common import fail, job_url, out
from llmbatch.contract.choices import Task

if TYPE_CHECKING:
    from llmbatch.config import Settings

app = typer.Typer()

TINY_EMBED_NOTE = (
    "[yellow]No --model given: embedding with a tiny model with random weights, built on "
    "this machine, run as an embedding model by vLLM's pooling runner. Its vectors are "
    "real vectors of a meaningless model.[/yellow] Name a real one with --model, e.g. "
    "--model intfloat/e5-small-v2 (needs the weights: a download or a local path)."
)
TINY_MODEL_NOTE = (
    "[yellow]No --model given: using a tiny model with random weights, built on this "
    "machine. Its answers are random (but always one of the industries, by the choice "
    "constraint).[/yellow] Name a real one with --model, e.g. "
    "--model Qwen/Qwen2.5-0.5B-Instruct (needs the weights: a download or a local path)."
)


@app.command("demo")
def demo(
    model: Annotated[
        str | None, typer.Option(help="Model id or path; default a tiny local model.")
    ] = None,
    rows: Annotated[int, typer.Option(help="Rows in the generated customers CSV.")] = 3000,
    shard_size: Annotated[int, typer.Option(help="Rows per shard.")] = 500,
    task: Annotated[
        Task,
        typer.Option(help="generate: classify each company; embed: embed its description."),
    ] = Task.GENERATE,
) -> None:
    """Start the embedded stack and workers, classify a customers CSV (or, with --task
    embed, embed each company's description into a Parquet file), print the results."""
    import asyncio

    from llmbatch.config import Settings
    from llmbatch.devstack import DevStack, DevStackError
    from llmbatch.devstack.api import DevApi

    settings = Settings()
    try:
        status = DevStack(settings).up()
        api = DevApi(settings).up()
    except DevStackError as exc:
        raise fail(str(exc)) from None
    out.print(status.describe(), markup=False, highlight=False)
    out.print(api.describe(), markup=False, highlight=False)
    gpu_args = ["--max-model-len", "512"]
    if model is None:
        from llmbatch.devstack.tiny_model import build_tiny_model

        model = str(build_tiny_model(settings.state_dir.resolve() / "models" / "tiny-llama"))
        if task is Task.EMBED:
            # The tiny model is a decoder: vLLM's pooling runner makes it embed.
            gpu_args += ["--convert", "embed"]
            out.print(TINY_EMBED_NOTE)
        else:
            out.print(TINY_MODEL_NOTE)
    try:
        if task is Task.EMBED:
            asyncio.run(
                _run_embed_demo(
                    settings, model, rows=rows, shard_size=shard_size, gpu_args=gpu_args
                )
            )
        else:
            asyncio.run(_run_demo(settings, model, rows=rows, shard_size=shard_size))
    except Exception as exc:  # one line, and where to look
        raise fail(f"demo failed: {exc} (worker logs in {settings.state_dir / 'logs'})") from None
    out.print(
        f"The OpenAI Batch API answers at {api.base_url} (key in {api.key_file}): point "
        "an OpenAI client's base_url at it (README: OpenAI Batch API)."
    )
    out.print("The stack is still up for you to look around; stop it with: llm-batch dev down")


async def _run_embed_demo(
    settings: Settings, model: str, *, rows: int, shard_size: int, gpu_args: list[str]
) -> None:
    import asyncio

    from llmbatch import storage
    from llmbatch.cli._support.jobview import follow_job, print_summary
    from llmbatch.client.temporal import connect, start_job
    from llmbatch.contract.spec import JobSpec, OutputFormat
    from llmbatch.devstack import demo as d

    data_uri = f"s3://{settings.s3_bucket}/demo/customers-{rows}.csv"
    store = storage.stores.open_store(data_uri, settings)
    await asyncio.to_thread(store.put_bytes, data_uri, d.customers_csv(rows))
    out.print(f"uploaded {rows} customers to {data_uri}")
    client = await connect(settings)
    log_dir = Path(settings.state_dir) / "logs"
    args = [*gpu_args, "--task", Task.EMBED.value]
    with d.worker_processes(settings, model, log_dir=log_dir, gpu_args=args) as procs:
        out.print("starting workers (the GPU worker loads the embedding model once)...")
        await d.wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model, Task.EMBED)],
            procs=procs,
            within_s=600,
        )
        spec = JobSpec(
            job_id=f"demo-embed-customers-{rows}",
            task=Task.EMBED,
            inputs=[data_uri],
            text=d.EMBED_TEXT,
            model=model,
            id_field="Customer Id",
            output_fields=["Company", "City", "Country"],
            output_format=OutputFormat.PARQUET,
            shard_size=shard_size,
            output_uri=f"s3://{settings.s3_bucket}/results",
        )
        handle, started = await start_job(client, spec, settings=settings)
        out.print(
            f"job {spec.job_id} {'started' if started else 'exists already; following it'}: "
            f"{job_url(settings, spec.job_id)}"
        )
        summary = await follow_job(client, handle, settings=settings, quiet=False)
    print_summary(summary, as_json=False)
    root = summary.output_root
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    out.print(
        f"vectors: Parquet files {root}/part-*.parquet (column 'embedding', a fixed-size "
        "list<float32>, beside item_id, Company, City and Country). Load them with:",
        highlight=False,
    )
    out.print(
        "  import pyarrow.dataset as ds, pyarrow.fs as fs\n"
        f"  s3 = fs.S3FileSystem(endpoint_override={settings.s3_endpoint_url!r}, "
        "access_key=<LLMBATCH_S3_ACCESS_KEY_ID>, secret_key=<LLMBATCH_S3_SECRET_ACCESS_KEY>, "
        f"region={settings.s3_region!r})\n"
        # The folder holds the manifest and error files too: only Parquet parts are read.
        f"  table = ds.dataset('{bucket}/{prefix}/', filesystem=s3, format='parquet', "
        "exclude_invalid_files=True).to_table()\n"
        "  table.to_pandas()  # or polars.from_arrow(table), duckdb.arrow(table)\n"
        f"or see the first rows with: llm-batch results {spec.job_id}",
        markup=False,
        highlight=False,
    )


async def _run_demo(settings: Settings, model: str, *, rows: int, shard_size: int) -> None:
    import asyncio

    from llmbatch import storage
    from llmbatch.cli._support.jobview import follow_job, print_summary, show_results
    from llmbatch.client.temporal import connect, start_job
    from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
    from llmbatch.devstack import demo as d

    data_uri = f"s3://{settings.s3_bucket}/demo/customers-{rows}.csv"
    store = storage.stores.open_store(data_uri, settings)
    await asyncio.to_thread(store.put_bytes, data_uri, d.customers_csv(rows))
    out.print(f"uploaded {rows} customers to {data_uri}")

    client = await connect(settings)
    log_dir = Path(settings.state_dir) / "logs"
    gpu_args = ["--max-model-len", "512"]
    with d.worker_processes(settings, model, log_dir=log_dir, gpu_args=gpu_args) as procs:
        out.print("starting workers (the GPU worker loads the model once)...")
        await d.wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model)],
            procs=procs,
            within_s=600,
        )
        spec = JobSpec(
            job_id=f"demo-customers-{rows}",
            inputs=[data_uri],
            messages=[
                ChatMessage(role="system", content=d.SYSTEM_PROMPT),
                ChatMessage(role="user", content=d.USER_PROMPT),
            ],
            model=model,
            id_field="Customer Id",
            # Room for the longest industry even at a token per character (the tiny
            # model's tokenizer): a choice cut off by max_tokens is a dead item.
            sampling=SamplingSpec(choice=d.INDUSTRIES, max_tokens=16),
            shard_size=shard_size,
            output_uri=f"s3://{settings.s3_bucket}/results",
        )
        handle, started = await start_job(client, spec, settings=settings)
        out.print(
            f"job {spec.job_id} {'started' if started else 'exists already; following it'}: "
            f"{job_url(settings, spec.job_id)}"
        )
        summary = await follow_job(client, handle, settings=settings, quiet=False)
    print_summary(summary, as_json=False)
    await show_results(settings, spec.job_id, rows=3, as_json=False)
