"""``llm-batch endpoint add|list|show|update|remove``: remote endpoints, in Postgres.

The API key is never given here: ``--api-key-env`` names the environment variable
(``--api-key-file`` the file) that ``llm-batch worker remote`` reads it from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from llmbatch.cli._support.common import CliError, emit_json, out, run, with_pool
from llmbatch.contract.choices import EndpointVia

if TYPE_CHECKING:
    from pydantic import ValidationError

    from llmbatch.config import Settings

app = typer.Typer(
    name="endpoint",
    help="Remote OpenAI-compatible endpoints and their limits.",
    no_args_is_help=True,
)


def _settings() -> Settings:
    from llmbatch.config import Settings

    return Settings()


_BaseUrl = Annotated[str, typer.Option(help="The API's base URL, e.g. http://host:8000/v1.")]
_KeyEnv = Annotated[
    str | None, typer.Option(help="Name of the environment variable holding the API key.")
]
_KeyFile = Annotated[str | None, typer.Option(help="A file holding the API key (instead).")]
_Rpm = Annotated[
    int | None,
    typer.Option(help="Requests per minute, for all workers together (on update, 0: no limit)."),
]
_Tpm = Annotated[
    int | None,
    typer.Option(help="Tokens per minute, for all workers together (on update, 0: no limit)."),
]
_Conc = Annotated[int | None, typer.Option(help="Requests in flight per worker (default 64).")]
_InPrice = Annotated[float | None, typer.Option(help="USD per 1M prompt tokens.")]
_OutPrice = Annotated[float | None, typer.Option(help="USD per 1M completion tokens.")]
_Timeout = Annotated[float | None, typer.Option(help="Seconds one request may take (600).")]
_ServeAs = Annotated[
    list[str] | None,
    typer.Option(
        help="Route this model name to the endpoint (repeat): Batch API batches, submits and "
        "schedules naming it (chat or completions) run here. On update, replaces the list; "
        "'' clears it."
    ),
]
_ServeEmbeddingsAs = Annotated[
    list[str] | None,
    typer.Option(help="As --serve-as, for embeddings (/v1/embeddings, --task embed)."),
]
_ServeVia = Annotated[
    EndpointVia | None,
    typer.Option(
        help="How the models routed here (--serve-as) run: 'online' (the default) on the "
        "endpoint's remote workers, or 'batch' through its Batch API (needs --batch-api) "
        "at its batch prices. For every route of the endpoint's chat and completions."
    ),
]
_BatchApi = Annotated[
    bool,
    typer.Option(
        "--batch-api",
        help="It speaks OpenAI's Files + Batches API: jobs may run on it with --via batch.",
    ),
]
_BatchIn = Annotated[float | None, typer.Option(help="Batch API: USD per 1M prompt tokens.")]
_BatchOut = Annotated[float | None, typer.Option(help="Batch API: USD per 1M completion tokens.")]
_BatchRequests = Annotated[
    int | None, typer.Option(help="Batch API: requests a batch may hold (50000).")
]
_BatchBytes = Annotated[int | None, typer.Option(help="Batch API: bytes a requests file may hold.")]
_BatchFlight = Annotated[
    int | None,
    typer.Option(
        help="Batch API: batches in flight at once, across all jobs and workers (100); "
        "a shard waits for a free slot before it creates its batch."
    ),
]
_BatchWindow = Annotated[
    str | None, typer.Option(help="Batch API: the completion window asked for ('24h').")
]


# The command parameters of the Batch API's options, and the fields they set.
_BATCH_FIELDS = {
    "batch_input_price": "batch_input_price",
    "batch_output_price": "batch_output_price",
    "batch_max_requests": "max_requests",
    "batch_max_bytes": "max_bytes",
    "batch_max_in_flight": "max_in_flight",
    "batch_window": "completion_window",
}


def _batch_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """The Batch API options among a command's parameters ``given``, or None when
    neither --batch-api nor one of them was given."""
    changes = {f: given[p] for p, f in _BATCH_FIELDS.items() if given[p] is not None}
    return changes if given["batch_api"] or changes else None


async def _set_batch_api(pool: Any, name: str, changes: dict[str, Any] | None) -> None:
    from pydantic import ValidationError

    from llmbatch.provider.settings import set_batch_api

    if changes is None:
        return
    try:
        await set_batch_api(pool, name, changes)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _options(**given: Any) -> dict[str, Any]:
    names = {"timeout": "timeout_s"}
    return {names.get(k, k): v for k, v in given.items() if v is not None}


def _invalid(exc: ValidationError) -> CliError:
    problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return CliError(f"invalid endpoint: {problems}")


@app.command("add")
def add(
    name: Annotated[str, typer.Argument()],
    base_url: _BaseUrl,
    api_key_env: _KeyEnv = None,
    api_key_file: _KeyFile = None,
    rpm: _Rpm = None,
    tpm: _Tpm = None,
    max_concurrency: _Conc = None,
    input_price: _InPrice = None,
    output_price: _OutPrice = None,
    timeout: _Timeout = None,
    serve_as: _ServeAs = None,
    serve_embeddings_as: _ServeEmbeddingsAs = None,
    serve_via: _ServeVia = None,
    batch_api: _BatchApi = False,
    batch_input_price: _BatchIn = None,
    batch_output_price: _BatchOut = None,
    batch_max_requests: _BatchRequests = None,
    batch_max_bytes: _BatchBytes = None,
    batch_max_in_flight: _BatchFlight = None,
    batch_window: _BatchWindow = None,
) -> None:
    """Declare an OpenAI-compatible endpoint (a vLLM/SGLang/TGI server, a gateway, an API)."""
    from pydantic import ValidationError

    from llmbatch.ledger.db import transaction
    from llmbatch.remote.endpoints import EndpointConfig, EndpointError, add_endpoint

    try:
        config = EndpointConfig(
            name=name,
            base_url=base_url,
            **_options(
                api_key_env=api_key_env,
                api_key_file=api_key_file,
                rpm=rpm,
                tpm=tpm,
                max_concurrency=max_concurrency,
                input_price=input_price,
                output_price=output_price,
                timeout=timeout,
            ),
        )
    except ValidationError as exc:
        raise _invalid(exc) from None

    batch = _batch_options(locals())

    async def use(pool: Any) -> Any:
        try:
            async with transaction(pool) as conn:
                endpoint = await add_endpoint(conn, config)
                await _set_routes(conn, name, serve_as, serve_embeddings_as)
                await _set_batch_api(conn, name, batch)
                await _set_serve_via(conn, name, serve_via)
                return endpoint, await _served(conn, name)
        except EndpointError as exc:
            raise CliError(str(exc)) from None

    endpoint, served = run(with_pool(_settings(), use))
    out.print(
        f"endpoint [bold]{endpoint.name}[/bold] added: {_line(endpoint, served)}", highlight=False
    )


@app.command("update")
def update(
    name: Annotated[str, typer.Argument()],
    base_url: Annotated[str | None, typer.Option(help="The API's base URL.")] = None,
    api_key_env: _KeyEnv = None,
    api_key_file: _KeyFile = None,
    rpm: _Rpm = None,
    tpm: _Tpm = None,
    max_concurrency: _Conc = None,
    input_price: _InPrice = None,
    output_price: _OutPrice = None,
    timeout: _Timeout = None,
    serve_as: _ServeAs = None,
    serve_embeddings_as: _ServeEmbeddingsAs = None,
    serve_via: _ServeVia = None,
    batch_api: _BatchApi = False,
    batch_input_price: _BatchIn = None,
    batch_output_price: _BatchOut = None,
    batch_max_requests: _BatchRequests = None,
    batch_max_bytes: _BatchBytes = None,
    batch_max_in_flight: _BatchFlight = None,
    batch_window: _BatchWindow = None,
) -> None:
    """Change some of an endpoint's options; running workers take them within seconds.
    Any update (even with no option) also lifts the endpoint's Retry-After wait."""
    from pydantic import ValidationError

    from llmbatch.ledger.db import transaction
    from llmbatch.remote.endpoints import EndpointError, update_endpoint
    from llmbatch.remote.status import endpoint_state

    changes = _options(
        base_url=base_url,
        api_key_env=api_key_env,
        api_key_file=api_key_file,
        rpm=rpm,
        tpm=tpm,
        max_concurrency=max_concurrency,
        input_price=input_price,
        output_price=output_price,
        timeout=timeout,
    )
    # 0 removes a limit (None, not given, keeps it).
    changes.update({limit: None for limit in ("rpm", "tpm") if changes.get(limit) == 0})

    batch = _batch_options(locals())

    async def use(pool: Any) -> Any:
        try:
            async with transaction(pool) as conn:
                before = await endpoint_state(conn, name)
                endpoint = await update_endpoint(conn, name, changes)
                await _set_routes(conn, name, serve_as, serve_embeddings_as)
                await _set_batch_api(conn, name, batch)
                await _set_serve_via(conn, name, serve_via)
                return endpoint, await _served(conn, name), before
        except LookupError:
            raise CliError(f"no endpoint named {name}") from None
        except EndpointError as exc:
            raise CliError(str(exc)) from None
        except ValidationError as exc:
            raise _invalid(exc) from None

    endpoint, served, before = run(with_pool(_settings(), use))
    out.print(f"endpoint [bold]{endpoint.name}[/bold]: {_line(endpoint, served)}", highlight=False)
    if before.blocked_s > 0:
        why = escape(before.blocked_reason or "Retry-After")
        out.print(
            f"  lifted its wait of {before.blocked_s:.1f} s more ({why}): every worker "
            "sends again within seconds",
            highlight=False,
        )


@app.command("list")
def list_(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every endpoint, with its limits and prices."""
    from llmbatch.remote.endpoints import list_endpoints

    async def use(pool: Any) -> Any:
        return [(e, await _served(pool, e.name)) for e in await list_endpoints(pool)]

    endpoints = run(with_pool(_settings(), use))
    if as_json:
        emit_json([{**e.model_dump(mode="json"), "serves": served} for e, served in endpoints])
        return
    if not endpoints:
        out.print("no endpoints (declare one with llm-batch endpoint add)")
    for endpoint, served in endpoints:
        out.print(f"[bold]{endpoint.name}[/bold]: {_line(endpoint, served)}", highlight=False)


@app.command("show")
def show(
    name: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """One endpoint: its shared send rate, any wait and why, its last error, counters."""
    from llmbatch.provider.settings import get_batch_api
    from llmbatch.remote.endpoints import EndpointError, get_endpoint
    from llmbatch.remote.status import endpoint_state

    async def use(pool: Any) -> Any:
        try:
            endpoint = await get_endpoint(pool, name)
            return (
                endpoint,
                await _served(pool, name),
                await endpoint_state(pool, name),
                await get_batch_api(pool, name),
            )
        except EndpointError as exc:
            raise CliError(str(exc)) from None

    endpoint, served, state, batch_api = run(with_pool(_settings(), use))
    if as_json:
        batch = {"batch_api": batch_api.model_dump() if batch_api else None}
        emit_json(
            {**endpoint.model_dump(mode="json"), "serves": served, **state.as_dict(), **batch}
        )
        return
    out.print(f"[bold]{endpoint.name}[/bold]: {_line(endpoint, served)}", highlight=False)
    out.print(f"  {escape(state.line())}", highlight=False)
    if (error := state.error_line()) is not None:
        out.print(f"  {escape(error)}", highlight=False)
    if batch_api is not None:
        out.print(f"  Batch API: {batch_api.line()}", highlight=False)


@app.command("remove")
def remove(name: Annotated[str, typer.Argument()]) -> None:
    """Forget an endpoint (its jobs' figures stay)."""
    from llmbatch.remote.endpoints import EndpointError, remove_endpoint

    async def use(pool: Any) -> None:
        try:
            await remove_endpoint(pool, name)
        except EndpointError as exc:
            raise CliError(str(exc)) from None

    run(with_pool(_settings(), use))
    out.print(f"endpoint [bold]{name}[/bold] removed")


async def _set_routes(
    db: Any, name: str, serve_as: list[str] | None, serve_embeddings_as: list[str] | None
) -> None:
    """The routes given (each list replaces the endpoint's routes of its task)."""
    from llmbatch.contract.choices import Task
    from llmbatch.remote.routes import set_routes

    for task, models in ((Task.GENERATE, serve_as), (Task.EMBED, serve_embeddings_as)):
        if models is not None:
            await set_routes(db, endpoint=name, task=task, models=models)


async def _set_serve_via(db: Any, name: str, via: EndpointVia | None) -> None:
    """``--serve-via``: after the routes and the Batch API given, so that one command
    may declare all three; a route via batch needs the endpoint's Batch API."""
    from llmbatch.provider.settings import batch_endpoint
    from llmbatch.remote.endpoints import EndpointError
    from llmbatch.remote.routes import set_via

    if via is None:
        return
    if via is EndpointVia.BATCH:
        await batch_endpoint(db, name)
    if not await set_via(db, endpoint=name, via=via):
        raise EndpointError(
            f"no model is routed to endpoint {name} for chat or completions: "
            "give --serve-as MODEL with --serve-via"
        )


async def _served(db: Any, name: str) -> dict[str, list[str]]:
    """The models routed to the endpoint, by task (``generate via batch``: the
    generate routes that run through its Batch API)."""
    from llmbatch.remote.routes import routes

    served: dict[str, list[str]] = {}
    for route in await routes(db, endpoint=name):
        via = " via batch" if route.via is EndpointVia.BATCH else ""
        served.setdefault(f"{route.task}{via}", []).append(route.model)
    return served


def _line(endpoint: Any, served: dict[str, list[str]]) -> str:
    limits = ", ".join(
        f"{label} {value}"
        for label, value in (
            ("rpm", endpoint.rpm),
            ("tpm", endpoint.tpm),
            ("concurrency", endpoint.max_concurrency),
            ("timeout", f"{endpoint.timeout_s:g}s"),
        )
        if value is not None
    )
    key = (
        f"key from ${endpoint.api_key_env}"
        if endpoint.api_key_env
        else f"key from file {endpoint.api_key_file}"
        if endpoint.api_key_file
        else "no key"
    )
    prices = (
        f", ${endpoint.input_price or 0:g}/${endpoint.output_price or 0:g} per 1M in/out"
        if endpoint.input_price is not None or endpoint.output_price is not None
        else ""
    )
    serves = "".join(
        f"; serves {', '.join(models)}" + (f" ({task})" if task != "generate" else "")
        for task, models in sorted(served.items(), reverse=True)
    )
    return f"{endpoint.base_url} ({key}; {limits}{prices}){serves}"
