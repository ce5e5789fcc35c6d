"""vLLM on CPU: whether we are on one, the environment an embedding engine's processes
get, and the memory sizing of the KV cache (from the memory node vLLM binds the
engine to), refused in one line when the settings cannot fit.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
from collections.abc import (
    Iterator,
    Mapping,
)
from dataclasses import dataclass

from vllm.engine.arg_utils import AsyncEngineArgs

from llmbatch.engine.errors import EngineArgumentError

# What vLLM uses on CPU when the caller does not say (see EngineOptions).
CPU_DTYPE = "float32"


# On CPU, with neither --kv-cache-memory-bytes nor --gpu-memory-utilization given, the
# KV cache gets this share of what the engine's memory node has free at start (see
# cpu_kv_cache_bytes), within these bounds.
CPU_KV_SHARE = 0.4


CPU_KV_MIN_BYTES = 64 << 20


CPU_KV_MAX_BYTES = 64 << 30


# What an engine process holds on CPU before its KV cache, beside the weights (torch,
# vLLM, oneDNN; 0.68 GiB measured with the tiny model): a --gpu-memory-utilization
# share smaller than this plus the weights leaves the KV cache nothing.
CPU_ENGINE_OVERHEAD_BYTES = 768 << 20


def on_cpu() -> bool:
    """True when vLLM runs on its CPU platform (no GPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_engine_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables to add for an embedding (pooling) engine's processes
    on CPU, so that a long job runs in flat memory (what ``environ`` sets is kept).

    vLLM's CPU linear layers run oneDNN matmuls, one primitive per number of tokens in
    a step; vLLM keeps its own LRU of 32 of them per weight shape, but oneDNN also
    keeps every primitive it creates in its process-wide cache (1024 by default).
    Embedding steps hold a different number of tokens nearly every time, so that
    second cache fills for the whole run: the model-runner process (``VLLM::Worker``)
    of an embed worker grew 2.2 MB per 1,000 rows, linearly (1.27 -> 1.38 GiB from
    20,000 to 60,000 rows, the benchmark's engine options). With the cache off
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``) it grew 1.253 -> 1.282 GiB; what was left
    is glibc malloc fragmentation from creating and dropping primitives, which
    tcmalloc (vLLM's recommended allocator on CPU, preloaded into the engine
    processes when the system has it) takes away: 1.204 -> 1.209 GiB, and as fast.
    In benchmarks/embeddings_vs_run_batch.py (20,000 then 200,000 rows) the model
    runner went 1.23 -> 1.50 GiB (workers +10.6%) before, 1.24 -> 1.27 GiB (+1.5%)
    with both, at the same items/s (890 and 900-940).
    """
    env: dict[str, str] = {}
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in environ:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "0"
    preload = environ.get("LD_PRELOAD", "")
    if "libtcmalloc" not in preload:
        # The library's file name; the dynamic loader finds it as it finds any library.
        tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library(
            "tcmalloc"
        )
        if tcmalloc:
            env["LD_PRELOAD"] = f"{tcmalloc}:{preload}" if preload else tcmalloc
    return env


@contextlib.contextmanager
def scoped_environ(added: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``added`` while the engine's processes start, and as it was
    afterwards: nothing else this process starts later (tests start many) inherits
    them."""
    saved = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in saved.items():
            if os.environ.get(name) != added[name]:
                continue  # changed meanwhile (vLLM sets LD_PRELOAD for its own): theirs
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class EngineMemoryError(EngineArgumentError):
    """The engine's memory settings do not fit the machine; one line naming what was
    asked, what the memory node has and which option to change."""


@dataclass(frozen=True)
class MemoryNode:
    """The memory node vLLM's CPU worker binds its engine to, as vLLM reads it."""

    node: int
    total_bytes: int
    available_bytes: int


def cpu_memory_node() -> MemoryNode:
    """The node of the first CPU the engine may run on, read with vLLM's own helpers:
    vLLM binds the engine's memory there and sizes its share from that node alone (on
    some machines node 0 holds 11 or even 3.6 of 24 GiB)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = int(get_allowed_cpu_list()[0].numa_node)
    info = get_memory_node_info(node)
    return MemoryNode(node, int(info.total_memory), int(info.available_memory))


def cpu_kv_cache_bytes(memory: MemoryNode) -> int:
    """A KV cache that fits ``memory``: a share of what the node has free now, within
    bounds. The rest stays for the engine process itself and for whatever else runs
    on the node (another worker, Postgres)."""
    share = int(memory.available_bytes * CPU_KV_SHARE)
    return max(CPU_KV_MIN_BYTES, min(CPU_KV_MAX_BYTES, share))


def check_cpu_memory(args: AsyncEngineArgs, memory: MemoryNode) -> None:
    """Refuse, in one line, the memory settings vLLM's CPU worker would refuse with a
    traceback after loading the model: a KV cache larger than the node has free, a
    share larger than the node has free, or a share too small to hold the engine
    process and its weights (vLLM's "negative KV cache")."""
    gib = 1 << 30
    node = (
        f"memory node {memory.node} has {memory.available_bytes / gib:.2f} GiB free "
        f"of {memory.total_bytes / gib:.2f} GiB"
    )
    kv = args.kv_cache_memory_bytes
    if kv is not None:
        if kv > memory.available_bytes:
            raise EngineMemoryError(
                f"the engine asks for a {kv / gib:.2f} GiB KV cache (--kv-cache-memory-bytes) "
                f"but {node}: give a smaller --kv-cache-memory-bytes, or leave it out to "
                "size the cache from the node"
            )
        return
    share = float(args.gpu_memory_utilization)
    asked = share * memory.total_bytes
    needed = CPU_ENGINE_OVERHEAD_BYTES + _weights_bytes(args.model)
    if asked > memory.available_bytes:
        problem = "more than the node has free"
    elif asked <= needed:
        problem = (
            f"less than the engine process needs before its KV cache "
            f"(about {needed / gib:.2f} GiB), so no KV cache would fit"
        )
    else:
        return
    raise EngineMemoryError(
        f"--gpu-memory-utilization {share:g} asks for {asked / gib:.2f} GiB on CPU (a share "
        f"of memory node {memory.node}, not of the machine), {problem}; {node}: give "
        "--kv-cache-memory-bytes (e.g. 512M) instead, or leave both out to size the KV "
        "cache from the node"
    )


def _weights_bytes(model: str) -> int:
    """The size of a local model folder's weight files (0 for a hub id: unknown here)."""
    folder = os.path.expanduser(model)
    if not os.path.isdir(folder):
        return 0
    return sum(
        entry.stat().st_size
        for entry in os.scandir(folder)
        if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )
