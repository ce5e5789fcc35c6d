"""The benchmarks' peer, ``vllm run-batch`` (vLLM's own batch runner), and the peak
RSS of a process tree: shared by every benchmark that measures llm-batch against it.

run-batch runs on the same file, model and engine options as llm-batch, and in the
same engine-process environment: an embedding worker adds ``cpu_engine_env()``
(oneDNN's process-wide primitive cache off, tcmalloc preloaded when the system has
it) for its engine's processes, and the embeddings benchmark gives run-batch the same
variables (``env``), so neither side has a memory or allocator setting the other lacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

TOPICS = ["a dog", "the sea", "tax law", "a bicycle", "rain", "a city", "music", "bread"]


def chat_lines(n: int, *, model: str, max_tokens: int, repeat: int = 1) -> bytes:
    """An OpenAI batch file of ``n`` greedy chat requests, each distinct one ``repeat``
    times: line i asks request i % (n // repeat), so repeats are spread over the file."""
    distinct = n // repeat
    lines = []
    for i in range(n):
        k = i % distinct
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are brief."},
                {"role": "user", "content": f"Write about {TOPICS[k % len(TOPICS)]} ({k})."},
            ],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        lines.append(json.dumps(line))
    return ("\n".join(lines) + "\n").encode()


class PeakRss:
    """Peak of the summed RSS of some processes and all their children, and each
    one's own peak (its process tree's)."""

    def __init__(self, roots: Sequence[psutil.Process | int]) -> None:
        self._roots = [r if isinstance(r, psutil.Process) else psutil.Process(r) for r in roots]
        self.peak = 0
        self.peaks = [0] * len(self._roots)
        # Each process's own peak, by "<root pid>:<name>" (the engine's are VLLM::...).
        self.by_process: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self, root: psutil.Process) -> int:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            try:
                rss = proc.memory_info().rss
                name = "main" if proc.pid == root.pid else proc.name()
            except psutil.Error:
                continue
            total += rss
            key = f"{root.pid}:{name}"
            self.by_process[key] = max(self.by_process.get(key, 0), rss)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            sizes = [self._tree(root) for root in self._roots]
            self.peaks = [max(a, b) for a, b in zip(self.peaks, sizes, strict=True)]
            self.peak = max(self.peak, sum(sizes))
            self._stop.wait(0.2)

    def describe(self, names: Sequence[str]) -> str:
        own = {str(root.pid): name for root, name in zip(self._roots, names, strict=True)}
        parts = [f"{n} {p / 2**30:.2f}" for n, p in zip(names, self.peaks, strict=True)]
        for key, peak in sorted(self.by_process.items()):
            pid, _, name = key.partition(":")
            parts.append(f"{own.get(pid, pid)}/{name} {peak / 2**30:.2f}")
        return ", ".join(parts)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class PeerRun:
    """One run-batch run: seconds on the batch (from when it starts reading the file,
    which it does only once its engine is up), seconds loading before that, lines
    without an error, and the peak RSS of its process tree."""

    batch_s: float
    load_s: float
    ok: int
    peak_rss: int


def run_batch(
    model: str,
    src: Path,
    dst: Path,
    engine_args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
) -> PeerRun:
    """Run ``vllm run-batch`` on ``src`` into ``dst``, with ``env`` added to its
    environment, and print one line about it."""
    started = time.monotonic()
    loaded = None
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(dst),
         "--model", model, *engine_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None
    with PeakRss([proc.pid]) as rss:
        for line in proc.stdout:  # vLLM logs to stdout
            if loaded is None and "Reading batch from" in line:
                loaded = time.monotonic()
        code = proc.wait()
    if code != 0 or loaded is None:
        raise RuntimeError(f"run-batch failed with exit code {code}")
    finished = time.monotonic()
    with dst.open() as f:
        ok = sum(1 for line in f if json.loads(line).get("error") is None)
    run = PeerRun(batch_s=finished - loaded, load_s=loaded - started, ok=ok, peak_rss=rss.peak)
    print(f"  run-batch: {run.batch_s:.1f} s batch + {run.load_s:.1f} s load, {ok} ok, "
          f"peak RSS {rss.peak / 2**30:.2f} GiB", flush=True)  # fmt: skip
    return run
