"""``llm-batch worker gpu``: its engine options are vLLM's own engine arguments.

No worker is started: the GPU worker's ``main`` is replaced, so these tests see the
EngineOptions it would be given.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from llmbatch.cli.main import app
from llmbatch.contract.spec import Task
from llmbatch.engine.options import EngineOptions


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[EngineOptions, dict[str, Any]]]:
    """What ``llmbatch.workers.gpu.main`` would have been called with (the services it would
    check first are taken as answering)."""
    from llmbatch.workers import gpu as gpu_worker
    from llmbatch.workers import preflight

    monkeypatch.setattr(preflight, "check_now", lambda _settings: None)

    calls: list[tuple[EngineOptions, dict[str, Any]]] = []
    monkeypatch.setattr(
        gpu_worker, "main", lambda _settings, options, **kw: calls.append((options, kw))
    )
    return calls


def test_vllm_engine_arguments_pass_through_with_the_workers_own(
    started: list[tuple[EngineOptions, dict[str, Any]]],
) -> None:
    # The flags the README, docker-compose.yml, benchmarks and test fixtures give, mixed
    # with the worker's own options as they do.
    result = CliRunner().invoke(
        app,
        ["worker", "gpu", "--model", "m", "--max-model-len", "512", "--max-num-seqs", "64",
         "--concurrent-shards", "2", "--gpu-memory-utilization", "0.2", "--dtype", "float32",
         "--enforce-eager", "--tensor-parallel-size", "1", "--max-in-flight", "8"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [(options, kwargs)] = started
    assert options.model == "m"
    assert options.engine_args == {
        "max_model_len": 512,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.2,
        "dtype": "float32",
        "enforce_eager": True,
        "tensor_parallel_size": 1,
    }
    assert kwargs == {"max_concurrent_activities": 2, "max_in_flight": 8, "task": Task.GENERATE}


def test_a_misspelt_engine_argument_is_refused_in_one_line(
    started: list[tuple[EngineOptions, dict[str, Any]]],
) -> None:
    result = CliRunner().invoke(app, ["worker", "gpu", "--model", "m", "--max-num-sqs", "4"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: unknown vLLM engine argument --max-num-sqs (did you mean --max-num-seqs?)"
    )
    assert not started


def test_engine_help_lists_vllms_arguments_without_a_model() -> None:
    result = CliRunner().invoke(app, ["worker", "gpu", "--engine-help", "prefix-caching"])
    assert result.exit_code == 0, result.output
    assert "--enable-prefix-caching" in result.stdout


def test_the_cli_starts_without_vllm() -> None:
    """Commands that do not run an engine never import vLLM (start-up time; the CPU
    worker's image need not have it), the GPU worker's --help included."""
    code = (
        "import sys\n"
        "from llmbatch.cli.main import app\n"
        "for args in (['--help'], ['worker', 'gpu', '--help'], ['submit', '--help']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_an_embed_worker_takes_its_task_and_vllms_pooling_options(
    started: list[tuple[EngineOptions, dict[str, Any]]],
) -> None:
    result = CliRunner().invoke(
        app, ["worker", "gpu", "--model", "m", "--task", "embed", "--convert", "embed"]
    )
    assert result.exit_code == 0, result.output
    [(options, kwargs)] = started
    assert kwargs["task"] is Task.EMBED and options.engine_args == {"convert": "embed"}
    # The pooling runner is implied for an embed worker, unless a runner is given.
    assert options.for_task(Task.EMBED).engine_args == {"convert": "embed", "runner": "pooling"}
    assert options.for_task(Task.GENERATE) == options
