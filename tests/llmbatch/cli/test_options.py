"""JobOptions.to_spec: the options of submit and schedule create become a JobSpec."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmbatch.cli.options import JobOptions
from llmbatch.config import Settings


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
