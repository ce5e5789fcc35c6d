"""The docs: reference pages current with the code, the site builds strictly, the README
stays a front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from llmbatch import reference
from llmbatch.cli.main import app
from llmbatch.config import Settings
from llmbatch.contract.explanations import (
    ENDPOINT_FAULT_HELP,
    ERROR_CLASS_HELP,
    FAILURE_TYPE_HELP,
    Explanation,
)
from llmbatch.contract.spec import JobSpec
from llmbatch.contract.states import EndpointFault, ErrorClass, FailureType
from llmbatch.telemetry import INSTRUMENTS

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "reference"


def _root() -> typer.core.TyperGroup:
    """The llm-batch command, as the docs command hands it to the reference."""
    root = typer.main.get_command(app)
    assert isinstance(root, typer.core.TyperGroup)  # an app of many commands
    return root


COMMAND = _root()


def test_committed_reference_matches_the_code(tmp_path: Path) -> None:
    written = reference.write(tmp_path, command=COMMAND)
    assert sorted(written) == sorted(reference.PAGES)
    stale = [
        name
        for name in reference.PAGES
        if not (COMMITTED / name).is_file()
        or (COMMITTED / name).read_text(encoding="utf-8")
        != (tmp_path / name).read_text(encoding="utf-8")
    ]
    assert not stale, f"docs/reference is stale ({', '.join(stale)}): run `llm-batch docs generate`"


def test_generation_is_deterministic_and_machine_free(tmp_path: Path) -> None:
    first = reference.render_all(COMMAND)
    assert reference.render_all(COMMAND) == first
    text = "\n".join(first.values())
    for machine in {str(Path.home()), os.getcwd(), str(ROOT)} - {"/"}:
        assert machine not in text


def test_check_command_fails_on_a_stale_page(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "reference"
    generated = runner.invoke(app, ["docs", "generate", "--out", str(out)])
    assert generated.exit_code == 0, generated.output
    current = runner.invoke(app, ["docs", "generate", "--out", str(out), "--check"])
    assert current.exit_code == 0, current.output

    page = out / "settings.md"
    page.write_text(page.read_text(encoding="utf-8").replace("LLMBATCH_S3_BUCKET", "X"))
    (out / "metrics.md").unlink()
    stale = runner.invoke(app, ["docs", "generate", "--out", str(out), "--check"])
    assert stale.exit_code == 1
    assert "settings.md, metrics.md" in stale.output
    assert "run `llm-batch docs generate`" in stale.output
    assert "X" in page.read_text(encoding="utf-8")  # --check writes nothing


def test_every_error_class_and_failure_type_has_cause_and_remedy() -> None:
    explained: list[tuple[ErrorClass | FailureType | EndpointFault, Explanation]] = [
        (m, ERROR_CLASS_HELP[m]) for m in ErrorClass
    ]
    explained += [(m, FAILURE_TYPE_HELP[m]) for m in FailureType]
    explained += [(m, ENDPOINT_FAULT_HELP[m]) for m in EndpointFault]
    for member, help in explained:
        assert help.cause.strip() and help.remedy.strip(), member


def test_every_setting_has_a_description() -> None:
    undescribed = [n for n, f in Settings.model_fields.items() if not f.description]
    assert not undescribed


def test_references_name_every_command_setting_error_and_metric() -> None:
    pages = reference.render_all(COMMAND)
    root = COMMAND
    ctx = typer.Context(root, info_name="llm-batch")
    for name in root.list_commands(ctx):
        sub = root.get_command(ctx, name)
        assert f"`llm-batch {name}" in pages["cli.md"]
        if isinstance(sub, typer.core.TyperGroup):
            sub_ctx = typer.Context(sub, info_name=name, parent=ctx)
            for leaf in sub.list_commands(sub_ctx):
                assert f"## llm-batch {name} {leaf}\n" in pages["cli.md"]
    for field in Settings.model_fields:
        assert f"`LLMBATCH_{field.upper()}`" in pages["settings.md"]
    for member in [*ErrorClass, *FailureType, *EndpointFault]:
        assert f"| `{member.value}` |" in pages["errors.md"]
    for instrument in INSTRUMENTS:
        assert f"`{instrument.name}`" in pages["metrics.md"]
    for field in ("inputs", "model", "messages", "sampling", "output_uri"):
        assert f"`{field}`" in pages["job-spec.md"]


def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert mkdocs.returncode == 0, mkdocs.stdout + mkdocs.stderr
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "reference" / "errors" / "index.html").is_file()


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    commands = re.findall(r"^make \w+", readme, flags=re.MULTILINE)
    assert commands[:2] == ["make demo", "make test"]
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), f"README links to a missing {target}"


def test_generated_pages_are_not_edited_by_hand() -> None:
    for name in reference.PAGES:
        text = (COMMITTED / name).read_text(encoding="utf-8")
        assert text.startswith("<!-- Generated by `llm-batch docs generate`")


def test_every_job_spec_field_has_a_description() -> None:
    schema = JobSpec.model_json_schema()
    models = {"JobSpec": schema, **schema["$defs"]}
    undescribed = [
        f"{name}.{field}"
        for name, model in models.items()
        for field, prop in model.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert not undescribed
