"""The benchmarks' peers, ``vllm run-batch`` (vLLM's own batch runner) and vLLM's
in-process ``AsyncLLM`` loop, the peak RSS of a process tree, the machine's load and
py-spy recordings: shared by every benchmark that measures llm-batch against them.

run-batch runs on the same file, model and engine options as llm-batch, and in the
same engine-process environment: an embedding worker adds ``cpu_engine_env()``
(oneDNN's process-wide primitive cache off, tcmalloc preloaded when the system has
it) for its engine's processes, and the embeddings benchmark gives run-batch the same
variables (``env``), so neither side has a memory or allocator setting the other lacks.

The in-process loop (``python benchmarks/peer.py loop ...``, run by
:func:`asyncllm_loop`) is what a program that embeds vLLM itself would run: one
``AsyncLLM`` built from the same engine arguments as llm-batch's GPU worker (through
the worker's own :class:`~llmbatch.engine.options.EngineOptions`), each chat request
rendered by vLLM's own chat path (the engine's renderer, as ``LLM.chat`` renders), and
``generate()`` async generators kept ``2 * max_num_seqs`` in flight (llm-batch's
default per activity), the results written as JSON lines. Its load is split off as
run-batch's is: the time counts from when it starts reading the batch file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from llmbatch.devstack.postgres_home import remove_tree

TOPICS = ["a dog", "the sea", "tax law", "a bicycle", "rain", "a city", "music", "bread"]


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Set to keep a benchmark's folder (its stack's data, model, inputs and logs) after it
# ends well; one that fails keeps it anyway, for its logs.
KEEP_ENV = "LLMBATCH_BENCH_KEEP"


def finished(work: Path) -> None:
    """The last step of a benchmark that ended well: its folder is removed (a run of ten
    million items leaves about 15 GB there) unless :data:`KEEP_ENV` is set."""
    if os.environ.get(KEEP_ENV):
        print(f"kept: {work}")
        return
    # With the Postgres data its stack keeps outside it (started as root from a
    # private folder: llmbatch.devstack.postgres_home).
    remove_tree(work)
    print(f"removed {work} ({KEEP_ENV}=1 keeps it)")


def cpu_seconds(pid: int, *, descendants: bool = True) -> float:
    """utime + stime (and reaped children's) of ``pid`` and, with ``descendants``, of
    every live process under it, from /proc/<pid>/stat."""
    pids = [pid]
    if descendants:
        try:
            pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            pass
    total = 0
    for p in pids:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields[11:15]: utime, stime, cutime, cstime (stat fields 14-17)
        total += sum(int(f) for f in fields[11:15])
    return total / CLOCK_TICKS


def load() -> str:
    """The machine's load averages (1, 5, 15 min): other work skews every figure."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def profiled(watched: dict[str, tuple[int, bool]], out: Path | None) -> Iterator[None]:
    """py-spy records each watched Python process (collapsed stacks, one file each)
    while the block runs; nothing when ``out`` is None."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, (pid, descendants) in watched.items():
        path = out / (name.split()[0] + ".txt")
        # Installed with the dev extra, beside this interpreter (a venv's bin is not always
        # on PATH).
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        cmd = [exe, "record", "--pid", str(pid), "--format", "raw",
               "--rate", "200", "--nonblocking", "--output", str(path)]  # fmt: skip
        if descendants:
            cmd.append("--subprocesses")
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for spy in spies:
            spy.wait(timeout=60)
        print(f"  py-spy profiles in {out}", flush=True)


def chat_lines(n: int, *, model: str, max_tokens: int, repeat: int = 1) -> bytes:
    """An OpenAI batch file of ``n`` greedy chat requests, each distinct one ``repeat``
    times: line i asks request i % (n // repeat), so repeats are spread over the file."""
    return "".join(iter_chat_lines(n, model=model, max_tokens=max_tokens, repeat=repeat)).encode()


def iter_chat_lines(n: int, *, model: str, max_tokens: int, repeat: int = 1) -> Iterator[str]:
    """The lines of :func:`chat_lines` one at a time (each ends in a newline), for
    files too large to hold in memory."""
    distinct = n // repeat
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
        yield json.dumps(line) + "\n"


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
    """One peer run: seconds on the batch (from when it starts reading the file, which
    it does only once its engine is up, to when it writes its output), seconds loading
    before that, seconds from the start of reading to the process's exit (the batch
    and the engine's shutdown), lines without an error, and the peak RSS of its
    process tree."""

    batch_s: float
    load_s: float
    exit_s: float
    ok: int
    peak_rss: int
    # CPU seconds over the batch of the peer's own process and of its engine's
    # processes (its descendants): what it spends outside the engine, and in it.
    cpu_own_s: float = 0.0
    cpu_engine_s: float = 0.0


# What a peer logs when its engine is up and it starts reading the batch file, and
# when its results are in and it writes them: the batch's time is between the two,
# for every peer alike (the engine's load before, its shutdown after, are not the
# batch's, as llm-batch's workers' load and shutdown are not its job's).
_READING = "Reading batch from"
_WRITING = "Writing outputs to local file"


def _run_peer(
    name: str, argv: Sequence[str], dst: Path, *, env: Mapping[str, str] | None
) -> PeerRun:
    """Run a peer's command, time it by its ``_READING`` and ``_WRITING`` lines and its
    exit, count the lines of ``dst`` without an error, and print one line about it."""
    started = time.monotonic()
    loaded = written = None
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None
    own = engine = (0.0, 0.0)
    with PeakRss([proc.pid]) as rss:
        for line in proc.stdout:  # vLLM logs to stdout
            if loaded is None and _READING in line:
                loaded = time.monotonic()
                own = (cpu_seconds(proc.pid, descendants=False), 0.0)
                engine = (cpu_seconds(proc.pid) - own[0], 0.0)
            elif written is None and _WRITING in line:
                written = time.monotonic()
                mine = cpu_seconds(proc.pid, descendants=False)
                own = (own[0], mine)
                engine = (engine[0], cpu_seconds(proc.pid) - mine)
        code = proc.wait()
    if code != 0 or loaded is None or written is None:
        raise RuntimeError(f"{name} failed with exit code {code}")
    finished = time.monotonic()
    with dst.open() as f:
        ok = sum(1 for line in f if json.loads(line).get("error") is None)
    run = PeerRun(
        batch_s=written - loaded,
        load_s=loaded - started,
        exit_s=finished - loaded,
        ok=ok,
        peak_rss=rss.peak,
        cpu_own_s=own[1] - own[0],
        cpu_engine_s=engine[1] - engine[0],
    )
    print(f"  {name}: {run.batch_s:.1f} s batch ({run.exit_s:.1f} s to exit) + "
          f"{run.load_s:.1f} s load, {ok} ok, peak RSS {rss.peak / 2**30:.2f} GiB, "
          f"CPU {run.cpu_own_s:.1f} s own process + {run.cpu_engine_s:.1f} s engine processes",
          flush=True)  # fmt: skip
    return run


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
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src),
            "-o", str(dst), "--model", model, *engine_args]  # fmt: skip
    return _run_peer("run-batch", argv, dst, env=env)


def asyncllm_loop(
    model: str,
    src: Path,
    dst: Path,
    engine_args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
) -> PeerRun:
    """Run vLLM's in-process ``AsyncLLM`` loop (this file's ``loop`` command) on
    ``src`` into ``dst`` in a process of its own, and print one line about it."""
    argv = [sys.executable, __file__, "loop", "-i", str(src), "-o", str(dst),
            "--model", model, *engine_args]  # fmt: skip
    return _run_peer("AsyncLLM loop", argv, dst, env=env)


async def _loop(model: str, src: Path, dst: Path, engine_argv: Sequence[str]) -> None:
    """The in-process loop: see the module docstring."""
    from vllm import SamplingParams
    from vllm.renderers import ChatParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from llmbatch.engine.options import EngineOptions

    args = EngineOptions.from_cli_args(model, engine_argv).to_engine_args()
    llm = AsyncLLM.from_engine_args(args)
    try:
        renderer = llm.renderer
        # As LLM.chat renders: the model's template with a generation prompt, and no
        # special tokens added by the tokenizer (the template writes them).
        chat = ChatParams(
            chat_template_kwargs={"add_generation_prompt": True, "continue_final_message": False}
        )
        tokens = renderer.default_chat_tok_params.with_kwargs(add_special_tokens=False)
        slots = asyncio.Semaphore(2 * llm.vllm_config.scheduler_config.max_num_seqs)
        print(f"{_READING} {src}", flush=True)
        text = await asyncio.to_thread(src.read_text)
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]

        async def one(line: dict[str, Any]) -> str:
            body = line["body"]
            params = SamplingParams(
                temperature=body.get("temperature", 1.0), max_tokens=body.get("max_tokens")
            )
            async with slots:
                _, (prompt,) = await renderer.render_chat_async([body["messages"]], chat, tokens)
                final = None
                async for out in llm.generate(prompt, params, request_id=line["custom_id"]):
                    final = out
            assert final is not None
            text = final.outputs[0].text
            return json.dumps({"custom_id": line["custom_id"], "text": text, "error": None})

        results = await asyncio.gather(*(one(line) for line in lines))
        print(f"{_WRITING} {dst}", flush=True)
        await asyncio.to_thread(dst.write_text, "\n".join(results) + "\n")
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description="vLLM's in-process AsyncLLM loop on a batch file")
    parser.add_argument("command", choices=["loop"])
    parser.add_argument("-i", dest="src", type=Path, required=True)
    parser.add_argument("-o", dest="dst", type=Path, required=True)
    parser.add_argument("--model", required=True)
    args, engine_argv = parser.parse_known_args()
    asyncio.run(_loop(args.model, args.src, args.dst, engine_argv))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
