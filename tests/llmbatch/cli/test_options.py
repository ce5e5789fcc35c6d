"""JobOptions.to_spec: the options of submit and schedule create become a JobSpec."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from llmbatch.cli._support.options import JobOptions
from llmbatch.config import Settings
from llmbatch.contract.spec import EmbedSpec, Task


def test_relative_paths_are_sent_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker would resolve a relative path against its own working directory.
    monkeypatch.chdir(tmp_path)
    options = JobOptions(
        inputs=["data/rows.csv", "/abs/rows.csv", "s3://b/in/*.csv", "file:///f/rows.csv"],
        model="m",
        output="results",
        user="{{ text }}",
    )
    spec = options.to_spec(Settings(), job_id="j")
    assert spec.inputs == [
        str(tmp_path / "data" / "rows.csv"),
        "/abs/rows.csv",
        "s3://b/in/*.csv",
        "file:///f/rows.csv",
    ]
    assert spec.output_uri == str(tmp_path / "results")
    home = JobOptions(inputs=["~/rows.csv"], model="m", output="s3://b/out", user="{{ x }}")
    spec = home.to_spec(Settings(), job_id="j")
    assert spec.inputs == [str(Path.home() / "rows.csv")] and spec.output_uri == "s3://b/out"


def test_priority_and_tenant_options_reach_the_spec() -> None:
    options = JobOptions(
        inputs=["s3://b/in.jsonl"],
        model="m",
        output="s3://b/out",
        user="{{ x }}",
        priority=1,
        tenant="eval-team",
        tenant_weight=2.0,
    )
    spec = options.to_spec(Settings(), job_id="j")
    assert (spec.priority, spec.tenant, spec.tenant_weight) == (1, "eval-team", 2.0)


def test_embed_options_go_to_the_embed_spec_and_truncation_to_the_task() -> None:
    embed = JobOptions(
        inputs=["s3://b/in.csv"], model="m", output="s3://b/out", task=Task.EMBED,
        text="{{ title }}", dimensions=64, normalize=False, truncate_prompt_tokens=100,
    ).to_spec(Settings(), job_id="j")  # fmt: skip
    assert (embed.task, embed.text) == ("embed", "{{ title }}")
    assert embed.embedding == EmbedSpec(dimensions=64, normalize=False, truncate_prompt_tokens=100)
    generate = JobOptions(
        inputs=["s3://b/in.csv"], model="m", output="s3://b/out", user="{{ x }}",
        truncate_prompt_tokens=100,
    ).to_spec(Settings(), job_id="j")  # fmt: skip
    assert generate.sampling.truncate_prompt_tokens == 100 and generate.embedding is None


def test_sampling_options_on_an_embed_job_exit_naming_the_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = JobOptions(
        inputs=["s3://b/in.csv"], model="m", output="s3://b/out", task=Task.EMBED,
        text="{{ x }}", max_tokens=5,
    )  # fmt: skip
    with pytest.raises(typer.Exit):
        options.to_spec(Settings(), job_id="j")
    assert "'sampling' options are for generate jobs" in capsys.readouterr().err
