"""llm-batch on a remote OpenAI-compatible server against the loop a user would write.

One vLLM OpenAI server on the tiny model (started here, or ``--server-url``), the same
chat requests for both:

1. client CPU per request: the official ``openai`` async client, httpx and aiohttp
   (the last two with msgspec's JSON), at the same concurrency, ``time.process_time``
   of this process over the requests (the server runs in another process);
2. no limit: a plain asyncio loop over the official client with a semaphore, against
   ``llm-batch worker remote`` running a job of the same requests (job wall time,
   workers already polling), ``--repeats`` rounds each, medians;
3. behind nginx limiting to ``--rate`` requests/s (``limit_req``, 429 beyond a burst
   of 5): the plain loop (the client's default 2 retries) and llm-batch with the
   endpoint declared at that rate; requests that passed per second, 429s, failures.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/remote_vs_client.py --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer import finished  # noqa: E402

from llmbatch import ledger  # noqa: E402
from llmbatch.client.temporal import connect, start_job  # noqa: E402
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec  # noqa: E402
from llmbatch.devstack import DevStack  # noqa: E402
from llmbatch.devstack.demo import settings_env, wait_for_pollers  # noqa: E402
from llmbatch.devstack.process import LoggedProcess, free_port  # noqa: E402
from llmbatch.devstack.stack import isolated_settings  # noqa: E402
from llmbatch.devstack.tiny_model import build_tiny_model  # noqa: E402
from llmbatch.remote.endpoints import EndpointConfig, add_endpoint  # noqa: E402
from tests.fixtures.openai_server import Gateway  # noqa: E402

KEY = "sk-bench"
KEY_ENV = "LLMBATCH_BENCH_KEY"


def prompts(n: int) -> list[str]:
    return [f"Write one sentence about the number {i}." for i in range(n)]


def start_server(model: str, log: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes",
             str(512 << 20), "--max-num-seqs", "256", "--disable-uvicorn-access-log",
             "--disable-log-stats"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    import urllib.request

    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, f"http://127.0.0.1:{port}/v1", port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()[-1000:]) from None
            time.sleep(0.5)
    raise TimeoutError("server did not start")


# --- 1. client CPU per request -------------------------------------------------------


async def _bounded(n: int, concurrency: int, call: Callable[[int], Awaitable[Any]]) -> int:
    slots = asyncio.Semaphore(concurrency)
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        async with slots:
            try:
                await call(i)
            except Exception:
                failed += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return failed


def _body(model: str, text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def _openai_loop(
    base_url: str, model: str, texts: list[str], max_tokens: int, *, max_retries: int
) -> tuple[Any, Callable[[int], Awaitable[Any]]]:
    """The official async client, and the call a user's loop makes with it."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=KEY, max_retries=max_retries, timeout=600
    )

    async def call(i: int) -> Any:
        return await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": texts[i]}],
            max_tokens=max_tokens,
            temperature=0.0,
        )

    return client, call


async def client_cpu(
    kind: str, base_url: str, model: str, n: int, concurrency: int, max_tokens: int
) -> tuple[float, float]:
    """(CPU ms per request in this process, wall s) for ``n`` requests with ``kind``."""
    texts = prompts(n)
    closer: Callable[[], Awaitable[Any]]
    if kind == "openai":
        client, call = _openai_loop(base_url, model, texts, max_tokens, max_retries=0)
        closer = client.close
    elif kind == "httpx":
        import httpx
        import msgspec

        hc = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            limits=httpx.Limits(max_connections=concurrency),
            timeout=600,
        )
        enc, dec = msgspec.json.Encoder(), msgspec.json.Decoder()

        async def call(i: int) -> Any:
            r = await hc.post(
                "/chat/completions", content=enc.encode(_body(model, texts[i], max_tokens))
            )
            r.raise_for_status()
            return dec.decode(r.content)

        closer = hc.aclose
    else:
        from llmbatch.remote.http import Transport, Verdict

        transport = Transport(base_url, api_key=KEY, timeout_s=600, max_connections=concurrency)

        async def call(i: int) -> Any:
            answer = await transport.post("/chat/completions", _body(model, texts[i], max_tokens))
            if answer.verdict is not Verdict.OK:
                raise RuntimeError(answer.message)
            return answer.body

        closer = transport.close
    await _bounded(min(50, n), concurrency, call)  # connections and imports warm
    cpu, wall = time.process_time(), time.perf_counter()
    failed = await _bounded(n, concurrency, call)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await closer()
    assert failed == 0, f"{kind}: {failed} failed"
    return cpu / n * 1000.0, wall


# --- 2 and 3: the plain loop, and llm-batch ------------------------------------------


async def plain_loop(
    base_url: str, model: str, n: int, concurrency: int, max_tokens: int
) -> tuple[float, int]:
    """(wall s, failed items) for the loop a user would write: the official client
    (its default retries) under a semaphore."""
    # The client's default retries (2), as a user's loop has them.
    client, call = _openai_loop(base_url, model, prompts(n), max_tokens, max_retries=2)

    started = time.perf_counter()
    failed = await _bounded(n, concurrency, call)
    wall = time.perf_counter() - started
    await client.close()
    return wall, failed


async def llm_batch_job(
    settings: Any, endpoint: str, model: str, n: int, max_tokens: int, work: Path
) -> tuple[float, int, int]:
    """(job wall s, succeeded, dead) of a job of the same requests on ``endpoint``."""
    client = await connect(settings)
    source = work / f"rows-{uuid.uuid4().hex[:6]}.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts(n)))
    spec = JobSpec(
        job_id=f"bench-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="{{ text }}")],
        model=model,
        remote_endpoint=endpoint,
        sampling=SamplingSpec(max_tokens=max_tokens),
        shard_size=500,
        max_concurrent_shards=8,
        # Same requests every round: the cache and dedup would answer them for free.
        cache=False,
        dedup=False,
        output_uri=f"file://{work / 'out'}",
    )
    started = time.perf_counter()
    handle, _ = await start_job(client, spec, settings=settings)
    summary = await handle.result()
    return time.perf_counter() - started, summary.items_succeeded, summary.items_dead


def workers(settings: Any, endpoint: str, log_dir: Path, concurrency: int) -> list[Any]:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **settings_env(settings), KEY_ENV: KEY}
    exe = [sys.executable, "-m", "llmbatch.cli.main", "worker"]
    procs = []
    for name, args in (
        ("cpu", ["cpu"]),
        ("remote", ["remote", "--endpoint", endpoint, "--max-in-flight", str(concurrency)]),
    ):
        procs.append(LoggedProcess([*exe, *args], log=log_dir / f"{name}-{endpoint}.log", env=env))
    return procs


def stop(procs: list[Any]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def rate_of(gateway: Gateway) -> tuple[float, int, int]:
    seen = gateway.requests("/chat/completions")
    passed = sorted(t for t, s in seen if s == 200)
    throttled = sum(1 for _, s in seen if s == 429)
    rate = (len(passed) - 1) / (passed[-1] - passed[0]) if len(passed) > 1 else 0.0
    return rate, len(passed), throttled


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="llmbatch-remote-bench-"))
    settings = isolated_settings(work / "stack", local_roots=[work])
    DevStack(settings).up()
    server = None
    try:
        model = args.model or str(build_tiny_model(work / "tiny-llama"))
        if args.server_url:
            port = int(args.server_url.split(":")[2].split("/")[0])
        else:
            server, _url, port = start_server(model, work / "server.log")
        n, c, mt = args.requests, args.concurrency, args.max_tokens
        parts = {int(p) for p in args.parts.split(",")}
        open_gw = Gateway(work / "gw-open", port, KEY).start()
        print(f"load average before: {os.getloadavg()}", flush=True)

        if 1 in parts:
            print(f"\n1. client CPU per request ({args.cpu_requests} requests, concurrency {c}):")
            for kind in ("openai", "httpx", "aiohttp"):
                runs = [
                    await client_cpu(kind, open_gw.base_url, model, args.cpu_requests, c, mt)
                    for _ in range(args.repeats)
                ]
                cpu_ms = statistics.median(r[0] for r in runs)
                wall = statistics.median(r[1] for r in runs)
                print(
                    f"  {kind:8s} {cpu_ms:6.3f} ms CPU/request, "
                    f"{args.cpu_requests / wall:7.1f} req/s"
                )

        pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
        client = await connect(settings)
        if 2 in parts:
            open_ep = f"open-{uuid.uuid4().hex[:6]}"
            await add_endpoint(
                pool,
                EndpointConfig(name=open_ep, base_url=open_gw.base_url, api_key_env=KEY_ENV,
                               max_concurrency=c),
            )  # fmt: skip
            procs = workers(settings, open_ep, work / "logs", c)
            queue = settings.gpu_task_queue(model, endpoint=open_ep)
            print(f"\n2. no limit: {n} requests, concurrency {c}, {args.repeats} rounds:")
            try:
                await wait_for_pollers(
                    client, [settings.cpu_task_queue, queue], procs=procs, within_s=300
                )
                plain, ours = [], []
                for r in range(args.repeats):
                    wall, failed = await plain_loop(open_gw.base_url, model, n, c, mt)
                    plain.append(n / wall)
                    job_s, ok, dead = await llm_batch_job(settings, open_ep, model, n, mt, work)
                    ours.append(ok / job_s)
                    print(f"  round {r + 1}: plain loop {n / wall:7.1f} items/s ({failed} "
                          f"failed), llm-batch {ok / job_s:7.1f} items/s ({ok} ok, {dead} dead)",
                          flush=True)  # fmt: skip
            finally:
                stop(procs)
            p, o = statistics.median(plain), statistics.median(ours)
            print(
                f"  medians: plain loop {p:.1f} items/s, llm-batch {o:.1f} items/s, "
                f"ratio {o / p:.2f}x"
            )

        if 3 in parts:
            rate, rn = args.rate, args.rate_requests
            print(f"\n3. behind a gateway at {rate} requests/s (burst 5): {rn} requests")
            gw_plain = Gateway(work / "gw-plain", port, KEY, rate=rate, burst=5).start()
            wall, failed = await plain_loop(gw_plain.base_url, model, rn, c, mt)
            r_plain, ok_plain, t_plain = rate_of(gw_plain)
            gw_plain.stop()
            print(f"  plain loop: {ok_plain} passed at {r_plain:.2f}/s, {t_plain} answered 429, "
                  f"{failed} items failed", flush=True)  # fmt: skip
            gw_ours = Gateway(work / "gw-ours", port, KEY, rate=rate, burst=5).start()
            limited = f"limited-{uuid.uuid4().hex[:6]}"
            await add_endpoint(
                pool,
                EndpointConfig(name=limited, base_url=gw_ours.base_url, api_key_env=KEY_ENV,
                               rpm=rate * 60, max_concurrency=c),
            )  # fmt: skip
            procs = workers(settings, limited, work / "logs", c)
            try:
                await wait_for_pollers(
                    client,
                    [settings.cpu_task_queue, settings.gpu_task_queue(model, endpoint=limited)],
                    procs=procs,
                    within_s=300,
                )
                job_s, ok, dead = await llm_batch_job(settings, limited, model, rn, mt, work)
            finally:
                stop(procs)
            r_ours, ok_ours, t_ours = rate_of(gw_ours)
            gw_ours.stop()
            print(f"  llm-batch:  {ok_ours} passed at {r_ours:.2f}/s ({r_ours / rate:.2f} R), "
                  f"{t_ours} answered 429, {ok} succeeded, {dead} dead, "
                  f"job {job_s:.1f} s")  # fmt: skip
        await pool.close()
        open_gw.stop()
        print(f"load average after: {os.getloadavg()}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        DevStack(settings).down()
    finished(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--cpu-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=int, default=20, help="gateway limit, requests/s")
    parser.add_argument("--rate-requests", type=int, default=600)
    parser.add_argument("--model", help="model path; default the tiny local model")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 3")
    parser.add_argument("--server-url", help="an OpenAI server already running on the model")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
