"""Peak memory of ``llm-batch serve`` while a large file goes up and comes back down.

Starts an embedded stack of its own (a temporary state folder, free ports) and one
``llm-batch serve`` process, makes an API key, writes a batch file of ``--mb`` MB
(OpenAI's limit, 200 MB, by default), then ``--repeats`` times uploads it with the
official client and downloads it again, sampling the server's RSS every 10 ms. Prints,
as medians: the server's RSS at rest, its peak while uploading and while downloading,
the growth over rest, and that growth as a share of the file (the peer: a server that
held the file in memory would show 1.0 or more).

    .venv/bin/python benchmarks/api_memory.py --mb 200 --repeats 3
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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import psutil

from llmbatch import ledger
from llmbatch.api.auth import create_key
from llmbatch.config import Settings
from llmbatch.devstack import DevStack, isolated_settings
from llmbatch.devstack.demo import settings_env
from llmbatch.devstack.process import free_port

MB = 1 << 20


def write_batch_file(path: Path, size: int) -> int:
    """OpenAI batch lines up to ``size`` bytes; returns the size written."""
    written = 0
    with path.open("wb") as f:
        n = 0
        while written < size:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"Tell me about item {n}. " * 8}],
                "max_tokens": 16,
            }
            line = (
                json.dumps(
                    {
                        "custom_id": f"r{n}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": body,
                    }
                ).encode()
                + b"\n"
            )
            f.write(line)
            written += len(line)
            n += 1
    return written


@contextmanager
def peak_rss(pid: int) -> Iterator[Callable[[], int]]:
    """Sample ``pid``'s RSS (with its children) every 10 ms; yields a getter of the peak."""
    proc = psutil.Process(pid)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                rss = proc.memory_info().rss + sum(
                    c.memory_info().rss for c in proc.children(recursive=True)
                )
            except psutil.Error:
                rss = 0
            peak[0] = max(peak[0], rss)
            stop.wait(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield lambda: peak[0]
    finally:
        stop.set()
        thread.join()


def serve(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmbatch.cli.main", "serve", "--port", str(settings.api_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **settings_env(settings)},
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llm-batch serve exited; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{settings.api_port}/v1/models", timeout=2)
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"llm-batch serve not up; see {log}")
        time.sleep(0.2)


async def new_key(settings: Settings) -> str:
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value(), max_size=1)
    try:
        return (await create_key(pool, project="bench")).secret
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="File size in MB.")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="llmbatch-api-mem-") as tmp:
        root = Path(tmp)
        settings = isolated_settings(
            root / "state", api_port=free_port(), api_max_file_bytes=1 << 40
        )
        stack = DevStack(settings)
        stack.up()
        proc: subprocess.Popen[bytes] | None = None
        try:
            proc = serve(settings, root / "serve.log")
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{settings.api_port}/v1",
                api_key=asyncio.run(new_key(settings)),
                max_retries=0,
                timeout=600,
            )
            path = root / "batch.jsonl"
            size = write_batch_file(path, args.mb * MB)
            time.sleep(1.0)
            rest = psutil.Process(proc.pid).memory_info().rss
            ups, downs, up_s, down_s = [], [], [], []
            for _ in range(args.repeats):
                with peak_rss(proc.pid) as peak, path.open("rb") as f:
                    began = time.monotonic()
                    uploaded = client.files.create(file=("batch.jsonl", f), purpose="batch")
                    up_s.append(time.monotonic() - began)
                    ups.append(peak())
                assert uploaded.bytes == size, (uploaded.bytes, size)
                with peak_rss(proc.pid) as peak:
                    began = time.monotonic()
                    got = 0
                    with client.files.with_streaming_response.content(uploaded.id) as response:
                        for chunk in response.iter_bytes(MB):
                            got += len(chunk)
                    down_s.append(time.monotonic() - began)
                    downs.append(peak())
                assert got == size, (got, size)
                client.files.delete(uploaded.id)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
            stack.down()

    def mib(n: float) -> str:
        return f"{n / MB:.0f} MiB"

    up, down = statistics.median(ups), statistics.median(downs)
    print(f"file: {size / MB:.0f} MiB, {args.repeats} rounds (medians)")
    print(f"server RSS at rest:        {mib(rest)}")
    print(
        f"peak while uploading:      {mib(up)} (+{mib(up - rest)}, "
        f"{(up - rest) / size:.3f}x the file; {size / MB / statistics.median(up_s):.0f} MiB/s)"
    )
    print(
        f"peak while downloading:    {mib(down)} (+{mib(down - rest)}, "
        f"{(down - rest) / size:.3f}x the file; {size / MB / statistics.median(down_s):.0f} MiB/s)"
    )


if __name__ == "__main__":
    main()
